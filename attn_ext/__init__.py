"""attn_ext: hand-written fused attention for PyTorch (C++ and CUDA kernels).

Public API:
    scaled_dot_product_attention   drop-in for torch.nn.functional.scaled_dot_product_attention
    attention_probs                the explicit attention probabilities, differentiable
    varlen_attention               attention over a packed batch of sequences of different lengths
    MultiHeadAttention             drop-in for torch.nn.MultiheadAttention (+ num_kv_heads, KVCache)
    KVCache                        keys/values of past tokens for incremental decoding
    convert_attention              swap every torch.nn.MultiheadAttention in a model for ours
    distributed                    context parallelism: ring_attention, shard, unshard over torch.distributed
"""

from . import distributed
from ._build import version as _version
from .modules import KVCache, MultiHeadAttention, convert_attention
from .ops import attention_probs, scaled_dot_product_attention, varlen_attention

__version__ = _version()

__all__ = [
    "scaled_dot_product_attention",
    "attention_probs",
    "varlen_attention",
    "MultiHeadAttention",
    "KVCache",
    "convert_attention",
    "__version__",
]
