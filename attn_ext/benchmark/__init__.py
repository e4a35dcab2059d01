"""attn_ext's side-by-side benchmarks (``python -m attn_ext bench``; the scripts in benchmarks/ call these).

common   timing (torch.utils.benchmark, interleaved rounds), peak memory, FLOP counts, tables
sdpa     attn_ext.scaled_dot_product_attention vs torch SDPA vs the plain softmax(QK^T)V, with plots
variants each attention variant (window, softcap, alibi, sinks, varlen) vs the ways to get it
         without it (``python -m attn_ext bench --variant NAME``)
decode   decoding steps vs torch SDPA over cache lengths, and the char GPT's tokens/s with a
         KVCache vs torch.nn.MultiheadAttention (``python -m attn_ext bench --decode``)
"""
