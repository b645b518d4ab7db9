// Runtime value -> template argument, for the dispatchers (fwd_dispatch.cu,
// bwd_dispatch.cu). The one list of kernel head dims this build compiled lives
// here: setup.py defines FAE_HAS_HDIM_<D> for each it built
// (FLASH_ATTN_EXT_HEAD_DIMS filters the generated instantiations).
#pragma once
#include <type_traits>

namespace flash_attn_ext {
namespace cuda {

template <int D>
using HeadDimTag = std::integral_constant<int, D>;

// Calls visit(HeadDimTag<D>{}) for every compiled kernel head dim D, ascending.
template <typename F>
void for_each_compiled_head_dim(F&& visit) {
#ifdef FAE_HAS_HDIM_32
  visit(HeadDimTag<32>{});
#endif
#ifdef FAE_HAS_HDIM_64
  visit(HeadDimTag<64>{});
#endif
#ifdef FAE_HAS_HDIM_96
  visit(HeadDimTag<96>{});
#endif
#ifdef FAE_HAS_HDIM_128
  visit(HeadDimTag<128>{});
#endif
#ifdef FAE_HAS_HDIM_160
  visit(HeadDimTag<160>{});
#endif
#ifdef FAE_HAS_HDIM_192
  visit(HeadDimTag<192>{});
#endif
#ifdef FAE_HAS_HDIM_224
  visit(HeadDimTag<224>{});
#endif
#ifdef FAE_HAS_HDIM_256
  visit(HeadDimTag<256>{});
#endif
}

// Calls run(HeadDimTag<kernel_dim>{}) when that head dim was compiled; returns
// whether it was.
template <typename F>
bool with_compiled_head_dim(int kernel_dim, F&& run) {
  bool found = false;
  for_each_compiled_head_dim([&](auto tag) {
    if (!found && decltype(tag)::value == kernel_dim) {
      found = true;
      run(tag);
    }
  });
  return found;
}

// Calls run(std::true_type{}) or run(std::false_type{}).
template <typename F>
void with_causal(bool causal, F&& run) {
  if (causal) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
