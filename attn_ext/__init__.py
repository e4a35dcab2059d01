"""attn_ext: hand-written fused attention for PyTorch (C++ and CUDA kernels).

Public API:
    scaled_dot_product_attention   drop-in for torch.nn.functional.scaled_dot_product_attention
    attention_probs                the explicit attention probabilities, differentiable
"""

from .ops import attention_probs, scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = ["scaled_dot_product_attention", "attention_probs", "__version__"]
