"""flash_attn_ext: exact FlashAttention (forward and backward) for PyTorch, on CPU and CUDA."""
from . import autotune, fp8
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache,
                        scaled_dot_product_attention)
from .ops import FlashAttnFunction, FlashAttnVarlenFunction, has_cuda_kernels
from .reference import attention_ref

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "scaled_dot_product_attention", "attention_ref", "FlashAttnFunction",
           "FlashAttnVarlenFunction", "has_cuda_kernels", "autotune", "fp8", "__version__",
           "ring_flash_attn_func", "ring_flash_attn_varlen_func", "zigzag_shard",
           "zigzag_unshard", "zigzag_shard_varlen", "zigzag_unshard_varlen"]

# Context parallelism (flash_attn_ext.distributed, over torch.distributed) is imported on
# first use, so that `import flash_attn_ext` stays as light as it was.
_DISTRIBUTED_EXPORTS = ("ring_flash_attn_func", "ring_flash_attn_varlen_func", "zigzag_shard",
                        "zigzag_unshard", "zigzag_shard_varlen", "zigzag_unshard_varlen")


def __getattr__(name):
    if name == "distributed" or name in _DISTRIBUTED_EXPORTS:
        import importlib
        distributed = importlib.import_module(".distributed", __name__)
        return distributed if name == "distributed" else getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
