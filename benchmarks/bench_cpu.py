"""attn_ext.scaled_dot_product_attention vs torch SDPA vs plain softmax(QK^T)V.

The implementation lives in attn_ext/benchmark/sdpa.py (so that
`python -m attn_ext bench` works from an installed package); this script is
the same with the README's default shape set. `--help` lists the options.
"""

import sys

from attn_ext.benchmark.sdpa import main

if __name__ == "__main__":
    sys.exit(main())
