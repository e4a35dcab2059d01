// attn_ext: asking for a matrix's rows ahead of reading them (no torch, no intrinsics).
//
// Rows of a (tokens, heads, dims) layout (a packed batch; transposed views of
// (B, L, H, E) projections) lie 1-2 KiB or more apart, a stride the hardware's
// prefetchers do not follow. The bfloat16 packs (amx_bf16.h) and the backward's
// rowsum(dO O) (attention_kernel_impl.h) ask for the rows they read next.
#pragma once

#include <cstdint>

namespace attn_ext {
namespace cpu {

constexpr int64_t kPrefetchRows = 32;  // how far ahead

// The first `bytes` bytes of rows [begin, end) of a matrix at base whose rows lie `stride` bytes apart.
inline void prefetch_rows(const void* base, int64_t stride, int64_t begin, int64_t end, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t r = begin; r < end; ++r)
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + r * stride + off);
}

}  // namespace cpu
}  // namespace attn_ext
