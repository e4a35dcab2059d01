// attn_ext's C++ API for LibTorch programs: the operators torch::ops attn_ext::*
// as C++ functions that call them through the dispatcher, so that the same call
// reaches the CPU or the CUDA kernels by the tensors' device, as any ATen op.
// Link libattn_ext (CMake: find_package(attn_ext), target attn_ext::attn_ext);
// its operators register themselves when the library loads.
//
// The arguments are the operators' schemas (csrc/ops.cpp; DESIGN.md gives the
// semantics): key j is visible from query row i iff j <= i + causal_offset when
// is_causal; scale is the softmax scale (1/sqrt(E) in SDPA); dropout_seed is
// an int64 tensor of one element on the query's device, required iff
// dropout_p > 0. The trailing variant arguments are DESIGN.md's "Attention
// variants": window sides (unset = unbounded), softcap, ALiBi slopes float32
// (Hq,) or (B, Hq), sinks (Hq,). Bad arguments raise c10::Error naming them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace attn_ext {
namespace detail {
template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}
using Opt = std::optional<at::Tensor>;
}  // namespace detail

// query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev), any strides,
// Hq % Hkv == 0; attn_mask bool or query's dtype, broadcastable to (B, Hq, L, S).
// Returns out (B, Hq, L, Ev) and the log-sum-exp of each row (B, Hq, L) in
// float32 (float64 for float64 inputs).
inline std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const detail::Opt& attn_mask,
    double dropout_p, bool is_causal, int64_t causal_offset, double scale, const detail::Opt& dropout_seed,
    std::optional<int64_t> window_left = std::nullopt, std::optional<int64_t> window_right = std::nullopt,
    std::optional<double> softcap = std::nullopt, const detail::Opt& alibi_slopes = std::nullopt,
    const detail::Opt& sinks = std::nullopt) {
  static const auto handle = detail::op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const detail::Opt&, double, bool, int64_t, double,
      const detail::Opt&, std::optional<int64_t>, std::optional<int64_t>, std::optional<double>, const detail::Opt&,
      const detail::Opt&)>("attn_ext::attention_forward");
  return handle.call(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed,
                     window_left, window_right, softcap, alibi_slopes, sinks);
}

// The gradients of attention_forward's inputs, given grad_out (B, Hq, L, Ev) and
// optionally grad_lse (B, Hq, L), and the forward's out and lse. Returns
// (grad_query, grad_key, grad_value, grad_mask, grad_sinks): grad_mask is (0,)
// unless compute_grad_mask (then attn_mask's shape), grad_sinks is (0,) without sinks.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const detail::Opt& grad_lse, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse, const detail::Opt& attn_mask,
    double dropout_p, bool is_causal, int64_t causal_offset, double scale, const detail::Opt& dropout_seed,
    std::optional<int64_t> window_left = std::nullopt, std::optional<int64_t> window_right = std::nullopt,
    std::optional<double> softcap = std::nullopt, const detail::Opt& alibi_slopes = std::nullopt,
    const detail::Opt& sinks = std::nullopt, bool compute_grad_mask = false) {
  static const auto handle =
      detail::op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const detail::Opt&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
          const at::Tensor&, const at::Tensor&, const detail::Opt&, double, bool, int64_t, double, const detail::Opt&,
          std::optional<int64_t>, std::optional<int64_t>, std::optional<double>, const detail::Opt&,
          const detail::Opt&, bool)>("attn_ext::attention_backward");
  return handle.call(grad_out, grad_lse, query, key, value, out, lse, attn_mask, dropout_p, is_causal, causal_offset,
                     scale, dropout_seed, window_left, window_right, softcap, alibi_slopes, sinks, compute_grad_mask);
}

// The explicit attention probabilities (B, Hq, L, S), with dropout applied as
// attention_forward applies it (so probs @ value == out), and lse (B, Hq, L).
inline std::tuple<at::Tensor, at::Tensor> attention_probs(
    const at::Tensor& query, const at::Tensor& key, const detail::Opt& attn_mask, double dropout_p, bool is_causal,
    int64_t causal_offset, double scale, const detail::Opt& dropout_seed,
    std::optional<int64_t> window_left = std::nullopt, std::optional<int64_t> window_right = std::nullopt,
    std::optional<double> softcap = std::nullopt, const detail::Opt& alibi_slopes = std::nullopt,
    const detail::Opt& sinks = std::nullopt) {
  static const auto handle = detail::op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const detail::Opt&, double, bool, int64_t, double, const detail::Opt&,
      std::optional<int64_t>, std::optional<int64_t>, std::optional<double>, const detail::Opt&,
      const detail::Opt&)>("attn_ext::attention_probs");
  return handle.call(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed, window_left,
                     window_right, softcap, alibi_slopes, sinks);
}

// The gradients of attention_probs' inputs: (grad_query, grad_key, grad_mask, grad_sinks).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_probs_backward(
    const at::Tensor& grad_probs, const detail::Opt& grad_lse, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& probs, const at::Tensor& lse, const detail::Opt& attn_mask, double dropout_p, bool is_causal,
    int64_t causal_offset, double scale, const detail::Opt& dropout_seed,
    std::optional<int64_t> window_left = std::nullopt, std::optional<int64_t> window_right = std::nullopt,
    std::optional<double> softcap = std::nullopt, const detail::Opt& alibi_slopes = std::nullopt,
    const detail::Opt& sinks = std::nullopt, bool compute_grad_mask = false) {
  static const auto handle = detail::op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const detail::Opt&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const detail::Opt&, double, bool, int64_t, double, const detail::Opt&,
      std::optional<int64_t>, std::optional<int64_t>, std::optional<double>, const detail::Opt&, const detail::Opt&,
      bool)>("attn_ext::attention_probs_backward");
  return handle.call(grad_probs, grad_lse, query, key, probs, lse, attn_mask, dropout_p, is_causal, causal_offset,
                     scale, dropout_seed, window_left, window_right, softcap, alibi_slopes, sinks, compute_grad_mask);
}

// A packed batch: query (total_q, Hq, E), key (total_k, Hkv, E), value
// (total_k, Hkv, Ev); sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1]) of
// the int32/int64 CPU tensors cu_seqlens_q/k (B + 1,). bottom_right aligns each
// sequence's last query with its last key. Returns out (total_q, Hq, Ev) and
// lse (total_q, Hq).
inline std::tuple<at::Tensor, at::Tensor> varlen_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal,
    bool bottom_right, double scale, const detail::Opt& dropout_seed,
    std::optional<int64_t> window_left = std::nullopt, std::optional<int64_t> window_right = std::nullopt,
    std::optional<double> softcap = std::nullopt, const detail::Opt& alibi_slopes = std::nullopt,
    const detail::Opt& sinks = std::nullopt) {
  static const auto handle = detail::op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
      double, bool, bool, double, const detail::Opt&, std::optional<int64_t>, std::optional<int64_t>,
      std::optional<double>, const detail::Opt&, const detail::Opt&)>("attn_ext::varlen_forward");
  return handle.call(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
                     bottom_right, scale, dropout_seed, window_left, window_right, softcap, alibi_slopes, sinks);
}

// The gradients of varlen_forward's inputs: (grad_query, grad_key, grad_value, grad_sinks).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_backward(
    const at::Tensor& grad_out, const detail::Opt& grad_lse, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal,
    bool bottom_right, double scale, const detail::Opt& dropout_seed,
    std::optional<int64_t> window_left = std::nullopt, std::optional<int64_t> window_right = std::nullopt,
    std::optional<double> softcap = std::nullopt, const detail::Opt& alibi_slopes = std::nullopt,
    const detail::Opt& sinks = std::nullopt) {
  static const auto handle = detail::op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const detail::Opt&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double, bool,
      bool, double, const detail::Opt&, std::optional<int64_t>, std::optional<int64_t>, std::optional<double>,
      const detail::Opt&, const detail::Opt&)>("attn_ext::varlen_backward");
  return handle.call(grad_out, grad_lse, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, is_causal, bottom_right, scale, dropout_seed, window_left, window_right,
                     softcap, alibi_slopes, sinks);
}

// What the library was built against and which kernels it holds: "key=value;key=value".
inline std::string build_info() {
  static const auto handle = detail::op<std::string()>("attn_ext::build_info");
  return handle.call();
}

}  // namespace attn_ext
