// CUDA implementations of flash_attn_ext::fwd / bwd: allocate outputs and
// scratch with torch, make inputs kernel-friendly (see flash_api.h for what
// the kernels may assume), call into the kernels on torch's current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <stdexcept>
#include <tuple>

#include "../ops_common.h"
#include "flash_api.h"

namespace flash_attn_ext {
namespace {

constexpr int kMaxHeadDim = 256;

bool is_aligned_16(const at::Tensor& t) {
  const int64_t elems = 16 / t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % elems == 0 &&
         t.stride(1) % elems == 0 && t.stride(2) % elems == 0;
}

// Kernels need 16-byte aligned rows and a head dim that is a multiple of 8.
// Most inputs already qualify (no copy). Otherwise pad the head dim with
// zeros (zeros leave QK^T unchanged, and the padded columns of O / dQ / dK /
// dV are sliced away) or copy to a fresh contiguous tensor.
at::Tensor kernel_friendly(const at::Tensor& t, int64_t padded_head_dim) {
  if (t.size(3) != padded_head_dim) {
    return at::constant_pad_nd(t, {0, padded_head_dim - t.size(3)}, 0);
  }
  return is_aligned_16(t) ? t : t.contiguous();
}

int64_t round_up_head_dim(int64_t d) { return (d + 7) / 8 * 8; }

void check_cuda_inputs(const at::Tensor& q) {
  TORCH_CHECK(q.is_cuda(), "flash_attn_ext: expected CUDA tensors, got ", q.device());
  TORCH_CHECK(q.size(3) <= kMaxHeadDim, "flash_attn_ext: head_dim must be <= ", kMaxHeadDim,
              " on CUDA, got ", q.size(3));
  const auto props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major >= 8, "flash_attn_ext: CUDA kernels need compute capability >= 8.0 (Ampere "
              "or newer), this GPU is ", props->major, ".", props->minor);
}

int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

template <typename F>
void call_kernels(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                            const at::Tensor& v_in, double softmax_scale,
                                            bool causal, bool causal_bottom_right,
                                            int64_t num_splits, int64_t tile) {
  // Validate the user's tensors first so messages name their shapes.
  make_fwd_params(q_in, k_in, v_in, softmax_scale, causal, causal_bottom_right);
  check_cuda_inputs(q_in);
  check_fwd_tuning_args(num_splits, tile);
  const c10::cuda::CUDAGuard guard(q_in.device());

  const int64_t head_dim = q_in.size(3);
  const int64_t head_dim_padded = round_up_head_dim(head_dim);
  at::Tensor q = kernel_friendly(q_in, head_dim_padded);
  at::Tensor k = kernel_friendly(k_in, head_dim_padded);
  at::Tensor v = kernel_friendly(v_in, head_dim_padded);
  AttentionFwdParams p = make_fwd_params(q, k, v, softmax_scale, causal, causal_bottom_right);

  // `out` has the layout the fake kernel promises (empty_like(q)); the kernel
  // writes into it directly unless it needs a padded / aligned scratch copy.
  at::Tensor out = at::empty_like(q_in);
  const bool write_direct = head_dim_padded == head_dim && is_aligned_16(out);
  at::Tensor out_kernel = write_direct ? out : at::empty(q.sizes(), q.options());
  at::Tensor lse = empty_lse(q);
  p.out = out_kernel.data_ptr();
  p.out_strides = strides_of(out_kernel);
  p.lse = lse.data_ptr<float>();
  p.num_splits = static_cast<int>(num_splits);
  p.fwd_tile = static_cast<int>(tile);

  const int splits = cuda::fwd_num_splits(p, num_sms());
  p.num_splits = splits;
  const int64_t ws_floats = cuda::fwd_workspace_floats(p, splits);
  at::Tensor workspace;
  if (ws_floats > 0) {
    workspace = at::empty({ws_floats}, q.options().dtype(at::kFloat));
    cuda::fwd_set_workspace(p, workspace.data_ptr<float>(), splits);
  }
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  call_kernels([&] { cuda::run_fwd(p, stream); });

  if (!write_direct) out.copy_(out_kernel.narrow(3, 0, head_dim));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse, double softmax_scale,
    bool causal, bool causal_bottom_right, bool deterministic) {
  make_bwd_params(dout_in, q_in, k_in, v_in, out_in, lse, softmax_scale, causal,
                  causal_bottom_right, deterministic);
  check_cuda_inputs(q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());

  const int64_t head_dim = q_in.size(3);
  const int64_t head_dim_padded = round_up_head_dim(head_dim);
  at::Tensor q = kernel_friendly(q_in, head_dim_padded);
  at::Tensor k = kernel_friendly(k_in, head_dim_padded);
  at::Tensor v = kernel_friendly(v_in, head_dim_padded);
  at::Tensor out = kernel_friendly(out_in, head_dim_padded);
  at::Tensor dout = kernel_friendly(dout_in, head_dim_padded);
  AttentionBwdParams p = make_bwd_params(dout, q, k, v, out, lse, softmax_scale, causal,
                                         causal_bottom_right, deterministic);

  // Gradients are allocated in the layout of their input (what the fake kernel
  // promises) and written directly unless a padded / aligned scratch is needed.
  const bool same_head_dim = head_dim_padded == head_dim;
  at::Tensor dq_user = at::empty_like(q_in), dk_user = at::empty_like(k_in),
             dv_user = at::empty_like(v_in);
  auto kernel_grad = [&](const at::Tensor& user, const at::Tensor& kernel_in) {
    return same_head_dim && is_aligned_16(user) ? user : at::empty(kernel_in.sizes(), kernel_in.options());
  };
  at::Tensor dq = kernel_grad(dq_user, q), dk = kernel_grad(dk_user, k), dv = kernel_grad(dv_user, v);
  set_grad_outputs(p, dq, dk, dv);

  const int sms = num_sms();
  at::Tensor workspace = at::empty({cuda::bwd_workspace_floats(p, sms)}, q.options().dtype(at::kFloat));
  cuda::bwd_set_workspace(p, workspace.data_ptr<float>(), sms);
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  call_kernels([&] { cuda::run_bwd(p, sms, stream); });

  auto to_user = [&](at::Tensor& user, const at::Tensor& g) {
    if (!g.is_same(user)) user.copy_(g.narrow(3, 0, head_dim));
  };
  to_user(dq_user, dq);
  to_user(dk_user, dk);
  to_user(dv_user, dv);
  return {dq_user, dk_user, dv_user};
}

}  // namespace

TORCH_LIBRARY_IMPL(flash_attn_ext, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
}

}  // namespace flash_attn_ext
