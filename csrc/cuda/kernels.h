// attn_ext: the CUDA kernels' entry points, called by the host code in
// attention_cuda.cpp. Torch-free: .cu files include only this, attention.h,
// attention_math.h and CUDA headers.
#pragma once

#include <cuda_runtime.h>

#include "../attention.h"

namespace attn_ext::cuda {

// Scratch of the backward, allocated by the host (torch's caching allocator)
// in the accumulation dtype (float32; float64 for float64 inputs), zeroed.
// The host casts the accumulators to the outputs afterwards and, for
// grouped-query attention, sums dk/dv over the query heads of each group.
//
// Without grouped-query attention the tensor-core backward can skip dk_accum
// and dv_accum: each of its CTAs owns some key rows and writes their dK, dV
// once, so with dk_out/dv_out set it writes them straight into the results,
// in the input dtype (no zeroing, no float32 round trip).
// A packed batch's accumulators are laid out as its tensors: (total_q, Hq, E)
// for dq, (total_k, Hq, E) and (total_k, Hq, Ev) for dk and dv, (total_q, Hq)
// for delta.
struct BwdWorkspace {
  void* dq_accum = nullptr;  // (B, Hq, L, E) contiguous
  void* dk_accum = nullptr;  // (B, Hq, S, E) contiguous, one slice per query head
  void* dv_accum = nullptr;  // (B, Hq, S, Ev) contiguous; unused for the probabilities' backward
  void* delta = nullptr;     // (B, Hq, L) contiguous: rowsum(dO * O) (or rowsum(dprobs * probs)) - dlse
  void* dk_out = nullptr;    // (B, Hkv, S, E) contiguous, input dtype; tensor-core kernel only, Hq == Hkv
  void* dv_out = nullptr;    // (B, Hkv, S, Ev) contiguous, likewise
};
// The mask's gradient goes to params.dmask (accumulation dtype, read through
// params.dmask_stride, which is 0 on broadcast dims): CUDA kernels add into it
// atomically; dmask_per_thread is always false on CUDA.

// The generic kernels: every dtype (float16/bfloat16 accumulate in float32),
// any head dims, every feature: masks, causal, windows, softcap, ALiBi, sinks
// (their gradient into params.dsinks), dropout, GQA, packed batches (params.cu_q
// and cu_k then in device memory), the explicit probabilities (params.probs /
// params.dprobs set). Any strides.
//
// Split-KV (flash-decoding): a call whose (b, h, query tile) tasks cannot fill
// the GPU (a decoding step: a query row or a few, a few heads, a long cache)
// splits each task's keys into n_splits ranges of keys_per_split keys (whole
// key tiles). Each split writes its rows' O (not yet divided by the row sum),
// row max m and row sum l to the workspace; a merge kernel joins the splits
// through the log-sum-exp (and the sinks) into out and lse. Never with
// dropout, the explicit probabilities, a packed batch or float64.
//
// Decode (decode set): calls with at most 8 query rows per key/value head (the
// group's query heads x L) run on a kernel of their own, one block per (b, kv
// head, key range), which reads each K and V row once for all those rows; it
// writes the same partial rows, and the merge follows even when n_splits is 1.
struct SplitKV {
  int64_t n_splits = 1;  // 1: no split (unless decode)
  bool decode = false;   // the decode kernel runs the key ranges
  int64_t keys_per_split = 0;
  void* o_part = nullptr;   // (n_splits, B, Hq, L, Ev) contiguous, accumulation dtype
  void* ml_part = nullptr;  // (n_splits, B, Hq, L, 2) contiguous, accumulation dtype: m, l of each row
};
// How the generic forward splits `params` on a device of num_sms SMs (the
// workspace pointers unset; n_splits 1 = no split).
SplitKV split_kv_plan(const AttnParams& params, int num_sms);
void forward_generic(const AttnParams& params, cudaStream_t stream, const SplitKV& split = SplitKV{});
void backward_generic(const AttnBwdParams& params, const BwdWorkspace& ws, cudaStream_t stream);

// The tensor-core kernels (FlashAttention-2 style): float16/bfloat16 on
// sm80+, E == Ev in the supported set, out/lse only (not the probabilities);
// masks, causal, windows, dropout, GQA, but no softcap, ALiBi, sinks or
// packed batch.
// Returns nullptr when they can run `params` on a device of compute
// capability (sm_major, sm_minor) that allows a block smem_per_block_optin
// bytes of shared memory (cudaDeviceProp::sharedMemPerBlockOptin), else the
// reason why not, in words.
const char* tensor_core_unsupported(const AttnParams& params, int sm_major, int sm_minor, int smem_per_block_optin);
void forward_tensor_core(const AttnParams& params, cudaStream_t stream);
void backward_tensor_core(const AttnBwdParams& params, const BwdWorkspace& ws, cudaStream_t stream);

}  // namespace attn_ext::cuda
