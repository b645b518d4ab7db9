"""flash_attn_ext: exact FlashAttention (forward and backward) for PyTorch, on CPU and CUDA."""
from . import autotune
from .interface import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                        scaled_dot_product_attention)
from .ops import FlashAttnFunction, FlashAttnVarlenFunction, has_cuda_kernels
from .reference import attention_ref

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "scaled_dot_product_attention", "attention_ref", "FlashAttnFunction",
           "FlashAttnVarlenFunction", "has_cuda_kernels", "autotune", "__version__"]
