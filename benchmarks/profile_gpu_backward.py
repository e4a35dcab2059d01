"""One bf16 forward+backward for Nsight Compute: attn_ext's or SDPA's flash.

B=8, H=16, L=2048, E=128, non-causal (benchmarks/results/gpu_h200_backward_profile.txt
compares the two main backward kernels at this shape). Two iterations; profile the
second's kernels, e.g. (what `scripts/gpu_lease.sh profile` runs):

    ncu --kernel-name-base demangled --kernel-name regex:attention_bwd_tc --launch-skip 1 --launch-count 1 \\
        python benchmarks/profile_gpu_backward.py ours
    ncu --kernel-name regex:flash_bwd_dq_dk_dv --launch-skip 1 --launch-count 1 \\
        python benchmarks/profile_gpu_backward.py flash
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attn_ext

B, H, L, E = 8, 16, 2048, 128


def main(which):
    if which not in ("ours", "flash"):
        print("usage: profile_gpu_backward.py ours|flash", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    grad = torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, generator=g)
    for _ in range(2):
        if which == "ours":
            out = attn_ext.scaled_dot_product_attention(q, k, v)
        else:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v)
        out.backward(grad)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
