// attn_ext: the CPU implementations of the operators: allocate the outputs,
// fill the parameter structs, run the kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../attention_math.h"
#include "../ops.h"
#include "kernels.h"

namespace attn_ext {
namespace {

// The transparent huge page size (/sys/kernel/mm/transparent_hugepage/hpage_pmd_size),
// 0 where there is none to ask for or ATTN_EXT_HUGE_PAGES=0 turns the advice off.
int64_t huge_page_bytes() {
  static const int64_t bytes = [] {
    const char* env = std::getenv("ATTN_EXT_HUGE_PAGES");
    if (env != nullptr && std::string(env) == "0") return int64_t(0);
    int64_t size = 0;
    std::ifstream("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") >> size;
    return size > 0 && (size & (size - 1)) == 0 ? size : int64_t(0);
  }();
  return bytes;
}

// Asks Linux to back a fresh output's whole huge pages with huge pages before
// the kernel writes it. Each first write to a 4 KiB page is a page fault: a
// fresh 32 MiB tensor took 9.9 ms to fill against 0.3 ms for the same tensor
// again, and 2.4 ms with the advice (AMD EPYC Zen 4, KVM; transparent huge
// pages in "madvise" mode). A 16384-token packed batch's forward writes such
// an output in about 130 ms: 3 % faster with the advice (best of five).
// PyTorch's own allocator does this for every tensor of 2 MiB or more under
// THP_MEM_ALLOC_ENABLE=1; here only the outputs of 4 MiB or more, which the
// kernels fill whole. In "never" mode the advice fails and nothing changes; in
// "always" mode the pages are huge already.
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t huge = huge_page_bytes();
  const int64_t bytes = t.numel() * int64_t(t.element_size());
  if (huge == 0 || bytes < std::max<int64_t>(2 * huge, int64_t(4) << 20) || !t.is_contiguous()) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t mask = uintptr_t(huge) - 1;
  const uintptr_t first = (begin + mask) & ~mask, last = (begin + uintptr_t(bytes)) & ~mask;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // a hint only
#else
  (void)t;
#endif
}

// How a mask's elements read, as their bits U. A key is hidden by a bool
// false (one byte, 0 or 1) or by a float -inf: exp(-inf) = 0 gives the key
// weight exactly 0, as false does, so either is a key the row does not see.
// A visible key is plain when the mask adds nothing to its score: a bool
// true, or a float +0 / -0 (the bits but the sign 0).
struct BoolBits {
  using U = uint8_t;
  static bool visible(U x) { return x != 0; }
  static bool plain(U x) { return x != 0; }
};
template <typename Bits, Bits kNegInf>
struct FloatBits {
  using U = Bits;
  static bool visible(U x) { return x != kNegInf; }
  static bool plain(U x) { return static_cast<U>(x << 1) == 0; }
};
using HalfBits = FloatBits<uint16_t, 0xFC00>;      // float16
using BFloat16Bits = FloatBits<uint16_t, 0xFF80>;  // bfloat16
using FloatMaskBits = FloatBits<uint32_t, 0xFF800000u>;
using DoubleBits = FloatBits<uint64_t, 0xFFF0000000000000ull>;

// The first and the last key that a mask row shows in [lo, hi) (keys stride
// apart): the index, or -1 when it shows none. A contiguous row is read 32 keys
// to a step (a branch-free OR over them, which the compiler vectorises), then
// one by one.
template <class Bits>
int64_t first_visible(const typename Bits::U* row, int64_t stride, int64_t lo, int64_t hi) {
  int64_t j = lo;
  if (stride == 1) {
    for (; j + 32 <= hi; j += 32) {
      unsigned any = 0;
      for (int64_t t = 0; t < 32; ++t) any |= unsigned(Bits::visible(row[j + t]));
      if (any != 0) break;
    }
  }
  for (; j < hi; ++j)
    if (Bits::visible(row[j * stride])) return j;
  return -1;
}

template <class Bits>
int64_t last_visible(const typename Bits::U* row, int64_t stride, int64_t lo, int64_t hi) {
  int64_t j = hi;  // keys [lo, j) are still to look at
  if (stride == 1) {
    for (; j - 32 >= lo; j -= 32) {
      unsigned any = 0;
      for (int64_t t = 0; t < 32; ++t) any |= unsigned(Bits::visible(row[j - 32 + t]));
      if (any != 0) break;
    }
  }
  while (j > lo)
    if (Bits::visible(row[--j * stride])) return j;
  return -1;
}

// Every key of [lo, hi) visible and plain: the mask row adds nothing there.
template <class Bits>
bool all_plain(const typename Bits::U* row, int64_t stride, int64_t lo, int64_t hi) {
  int64_t j = lo;
  if (stride == 1) {
    for (; j + 32 <= hi; j += 32) {
      unsigned odd = 0;
      for (int64_t t = 0; t < 32; ++t) odd |= unsigned(!Bits::plain(row[j + t]));
      if (odd != 0) return false;
    }
  }
  for (; j < hi; ++j)
    if (!Bits::plain(row[j * stride])) return false;
  return true;
}

// The keys that an attn_mask hides from every query row (bool false, or a
// float mask's -inf: either gives the key weight exactly 0) are left out: the
// kernels run on [key_begin, S) only, S cut after the last key some row sees
// and key_begin at the first. A preallocated cache behind a mask of its written
// slots (a static KV cache, as in gpt-fast or transformers' StaticCache under
// torch.compile, whose shapes cannot shrink with the cache) then costs what the
// written keys cost, not the whole cache; a left-padded batch's padding keys
// cost nothing. Every row's result is the same math: the keys left out have
// weight exactly 0, the causal offset, the window and ALiBi keep the uncut
// key indices (the ops take the offset as an argument), and dropout draws by
// key index. The backward's dK and dV are 0 outside the keys run on.
//
// A mask with a batch dim is read per batch entry, whose sequences may have
// written different numbers of slots or have different padding (requests at
// different positions of one cache, a left-padded batch): cut.entries then
// holds each entry's [begin, end), which the kernels run it on
// (AttnParams::batch_keys), and p.S the largest end; it stays empty when one
// range serves the batch. An entry whose rows see no key runs on key 0 alone.
//
// A mask that varies by query row (a causal or banded pattern as a bool mask,
// or as a float mask of 0 and -inf such as nn.Transformer's
// generate_square_subsequent_mask; packed documents' block-diagonal mask) is
// read row by row: cut.rows holds each row's [first, last + 1) over the heads
// (AttnParams::row_keys), and a forward query block visits only the key tiles
// its rows' ranges span, a backward key block only the query rows whose ranges
// reach it. Tiles the mask hides whole are then skipped as the causal flag's
// are.
//
// A mask that holds nothing but those ranges (every row's keys one unbroken
// run, the same on every head, and a float mask 0 on each: a key-padding or
// written-slots row, the causal pattern, a band, documents) is not read by the
// kernels at all: it is dropped, and the ranges stand for it (score_row bounds
// each row by its row_keys). Where the rows' ranges follow a causal bound or a
// window (flags_from_ranges: the call has none of its own), the kernels take
// those flags and skip what the flags let them skip, the products past each
// micro-kernel row group's diagonal: a causal or banded pattern becomes the
// flags alone, packed documents the causal flag beside each row's range.
//
// The scan reads each row from its end backwards down to the last key found so
// far, and from key 0 forwards up to the first; 32 keys to a step. It then
// reads the keys between on each head (all_plain) until a row breaks its run.
// The whole mask at most: O(mask), as the kernels' own reading of it. One key
// row of 32768 slots with 1 written: about 2 us, 8 such rows about 9 us (AMD
// EPYC Zen 4). A decoding step of 8 heads over a (1, 1, 1, 32768) mask of 4000
// written slots: 4.2 ms when float masks were not read, 0.17 ms (float32).
// Other large negative biases (transformers' finfo.min) are not -inf: a row
// that sees nothing else averages those keys, so they are not hidden. Nor is a
// float mask read for a backward that computes its gradient (which every
// element gets). CPU only: on CUDA the mask would have to be read on the host.
struct KeyCut {
  std::vector<int64_t> entries;  // (B, 2): each batch entry's keys, when they differ
  std::vector<int64_t> rows;     // (B or 1, L, 2): each query row's keys, when the mask varies by row
};

// The causal bound and window that a mask's row ranges follow (the call must
// have none of its own). rows[2 r], rows[2 r + 1]: row r = b L + i of mask entry
// b sees keys [begin, end) at most; entries: each entry's [begin, end).
//   Exact: the flags show each row exactly its range (within its entry's keys);
//     the ranges are not needed beside them.
//   Bound: the causal bound (or a window's right side) shows each row its range
//     and more (packed documents: causal, each row from its document's start);
//     the ranges stay beside it.
// p takes the flags in both cases. ALiBi measures distances from i +
// causal_offset, so with ALiBi the call's alignment stays and the bound becomes
// a window's right side when it is not the causal diagonal.
enum class RangeFlags { None, Bound, Exact };

RangeFlags flags_from_ranges(AttnParams& p, const std::vector<int64_t>& rows, const std::vector<int64_t>& entries,
                             int64_t nb) {
  if (p.causal || p.window_left >= 0 || p.window_right >= 0) return RangeFlags::None;
  const int64_t L = p.L;
  int64_t right_row = -1, left_row = -1;  // the first rows that end before / begin after their entry's keys
  for (int64_t r = 0; r < nb * L && (right_row < 0 || left_row < 0); ++r) {
    const int64_t b = r / L, begin = rows[2 * r], end = rows[2 * r + 1];
    if (begin >= end) continue;
    if (right_row < 0 && end < entries[2 * b + 1]) right_row = r;
    if (left_row < 0 && begin > entries[2 * b]) left_row = r;
  }
  AttnParams f = p;
  if (right_row >= 0) {
    const int64_t reach = rows[2 * right_row + 1] - 1 - right_row % L;  // row i's last key is i + reach
    if (p.alibi == nullptr) {
      f.causal = true;
      f.causal_offset = reach;
    } else if (reach == p.causal_offset) {
      f.causal = true;
    } else if (reach > p.causal_offset) {
      f.window_right = reach - p.causal_offset;
    } else {
      return RangeFlags::None;
    }
  }
  // Does every row's range equal (exact) or lie within the keys that g shows it?
  auto follow = [&](const AttnParams& g, bool exact) {
    for (int64_t b = 0; b < nb; ++b) {
      AttnParams entry = g;
      entry.key_begin = entries[2 * b];
      entry.S = entries[2 * b + 1];
      for (int64_t i = 0; i < L; ++i) {
        const KeyRange shown = visible_key_range(entry, i);
        const int64_t begin = rows[2 * (b * L + i)], end = rows[2 * (b * L + i) + 1];
        if (begin >= end ? exact && shown.begin < shown.end
                         : (exact ? shown.begin != begin || shown.end != end : shown.begin > begin || shown.end < end))
          return false;
      }
    }
    return true;
  };
  AttnParams windowed = f;
  if (left_row >= 0) windowed.window_left = left_row % L + f.causal_offset - rows[2 * left_row];
  RangeFlags kind = RangeFlags::None;
  if ((left_row < 0 || windowed.window_left >= 0) && follow(windowed, /*exact=*/true)) {
    f = windowed;
    kind = RangeFlags::Exact;
  } else if (right_row >= 0 && follow(f, /*exact=*/false)) {
    kind = RangeFlags::Bound;
  } else {
    return RangeFlags::None;
  }
  p.causal = f.causal;
  p.causal_offset = f.causal_offset;
  p.window_left = f.window_left;
  p.window_right = f.window_right;
  return kind;
}

// What reading a mask may do to the call's keys. Cut: leave out the keys
// no row sees (key_begin, S, batch_keys). KeepAll (attention_probs, which
// writes every key's probability): cut none; a mask that varies by row is read
// as its row ranges and flags only, and the ranges then always stay beside the
// flags (they hold the entries' ends that the cut holds otherwise).
enum class KeyUse { Cut, KeepAll };

// Reads a mask as what it shows (above), its elements read as Bits says:
// each row's range of keys, the flags those ranges follow, the keys no row
// sees (cut as `keys` says), and drops the mask where the ranges say all it
// holds. cut keeps the buffers p then points to.
template <class Bits>
void read_mask_as(AttnParams& p, KeyCut& cut, KeyUse keys) {
  const bool keep_keys = keys == KeyUse::KeepAll;
  const int64_t* stride = p.mask_stride;  // (B, Hq, L, S), 0 on broadcast dims
  if (keep_keys && stride[2] == 0) return;
  const auto* mask = static_cast<const typename Bits::U*>(p.mask);
  const int64_t S = p.S;
  const int64_t nb = stride[0] != 0 ? p.B : 1, nh = stride[1] != 0 ? p.Hq : 1, nl = stride[2] != 0 ? p.L : 1;
  auto row_of = [&](int64_t b, int64_t h, int64_t i) { return mask + b * stride[0] + h * stride[1] + i * stride[2]; };
  // Each query row's keys over the heads, from both ends inwards (a causal row is read from its
  // end down to its diagonal, and from key 0), the rows shared out between the threads (a large
  // mask is read at what memory gives each core); the entry's keys are their hull.
  std::vector<int64_t> rows(2 * nb * nl), found(2 * nb);
  std::atomic<bool> broken{false};  // a row's keys (on some head) are not one unbroken run
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (S * nh));  // 64 KiB of mask or more a task
  at::parallel_for(0, nb * nl, grain, [&](int64_t first_row, int64_t last_row) {
    for (int64_t r = first_row; r < last_row; ++r) {
      const int64_t b = r / nl, i = r % nl;
      int64_t begin = S, end = 0;  // empty so far
      for (int64_t h = 0; h < nh && (begin > 0 || end < S); ++h) {
        const int64_t last = last_visible<Bits>(row_of(b, h, i), stride[3], end, S);
        if (last >= 0) end = last + 1;
        const int64_t first = first_visible<Bits>(row_of(b, h, i), stride[3], 0, std::min(begin, end));
        if (first >= 0) begin = first;
      }
      // every head sets every key of the run: then each head's keys are the run, no more
      for (int64_t h = 0; h < nh && begin < end && !broken.load(std::memory_order_relaxed); ++h)
        if (!all_plain<Bits>(row_of(b, h, i), stride[3], begin, end)) broken.store(true, std::memory_order_relaxed);
      rows[2 * r] = begin;
      rows[2 * r + 1] = end;
    }
  });
  const bool runs = !broken.load();  // every row's keys one unbroken run
  bool hidden = false;               // an entry whose rows see no key
  for (int64_t b = 0; b < nb; ++b) {
    int64_t lo = S, hi = 0;
    for (int64_t r = b * nl; r < (b + 1) * nl; ++r) {
      lo = std::min(lo, rows[2 * r]);
      hi = std::max(hi, rows[2 * r + 1]);
    }
    hidden = hidden || hi == 0;
    found[2 * b] = hi > 0 ? lo : 0;
    found[2 * b + 1] = hi > 0 ? hi : 1;  // no row sees a key: key 0 alone
  }
  int64_t low = S, high = 0;
  bool same = true;
  for (int64_t b = 0; b < nb; ++b) {
    low = std::min(low, found[2 * b]);
    high = std::max(high, found[2 * b + 1]);
    same = same && found[2 * b] == found[0] && found[2 * b + 1] == found[1];
  }
  if (!keep_keys) {
    p.key_begin = low;
    p.S = high;
    if (!same) p.batch_keys = found.data();
  }
  // The mask is its ranges: the kernels need not read it (an entry that sees no key
  // needs it when there are no row ranges to say so).
  const bool drop = runs && (nl > 1 || !hidden);
  if (nl > 1) {
    if (flags_from_ranges(p, rows, found, nb) == RangeFlags::Exact && !keep_keys) {
      rows.clear();  // the flags (and the mask, when kept) say it all
    } else {
      p.row_keys = rows.data();
      p.row_keys_stride = nb > 1 ? 2 * nl : 0;
    }
  }
  if (drop) {
    p.mask_kind = MaskKind::None;
    p.mask = nullptr;
    std::fill(p.mask_stride, p.mask_stride + 4, int64_t(0));
  }
  cut.rows = std::move(rows);  // the buffers move with their pointers
  if (!same && !keep_keys) cut.entries = std::move(found);
}

// read_mask_as for the call's mask: bool, or float of the query's dtype.
void read_mask(AttnParams& p, KeyCut& cut, KeyUse keys = KeyUse::Cut) {
  cut.entries.clear();
  cut.rows.clear();
  if (p.mask_kind == MaskKind::None || p.S <= 1 || p.mask_stride[3] == 0 || p.B == 0 || p.Hq == 0 || p.L == 0)
    return;
  if (p.mask_kind == MaskKind::Bool) return read_mask_as<BoolBits>(p, cut, keys);
  switch (p.dtype) {
    case DType::Float16: return read_mask_as<HalfBits>(p, cut, keys);
    case DType::BFloat16: return read_mask_as<BFloat16Bits>(p, cut, keys);
    case DType::Float32: return read_mask_as<FloatMaskBits>(p, cut, keys);
    case DType::Float64: return read_mask_as<DoubleBits>(p, cut, keys);
  }
}

void read_seed(AttnParams& p, const std::optional<at::Tensor>& dropout_seed) {
  if (p.dropout_p > 0.0) p.seed = static_cast<uint64_t>(dropout_seed->item<int64_t>());
}

// The float32/float64 buffer the kernel accumulates the mask's gradient in.
// Tasks are (batch, key/value head) pairs, and for few pairs also chunks of
// their keys (backward_key_chunks); they hit the same mask element when the
// mask broadcasts over a dim they are split on (batch, key/value head, or
// keys), and then each thread accumulates into a copy of its own.
// sum_grad_mask_copies() sums the copies.
at::Tensor grad_mask_buffer(AttnBwdParams& p, const at::Tensor& attn_mask, at::ScalarType acc) {
  TORCH_CHECK(p.mask_kind == MaskKind::Additive, "attn_ext: compute_grad_mask needs a float attn_mask");
  std::vector<int64_t> shape(4 - attn_mask.dim(), 1);  // the mask's sizes, padded to 4-D
  for (int64_t size : attn_mask.sizes()) shape.push_back(size);
  const bool shared = (p.B > 1 && shape[0] == 1) || (p.Hkv > 1 && shape[1] == 1) || (p.S > 1 && shape[3] == 1);
  shape.insert(shape.begin(), shared ? at::get_num_threads() : 1);
  at::Tensor buffer = at::zeros(shape, attn_mask.options().dtype(acc));
  copy_strides(p.dmask_stride, buffer[0].expand({p.B, p.Hq, p.L, p.S}));
  p.dmask = buffer.data_ptr();
  p.dmask_numel = buffer[0].numel();
  p.dmask_per_thread = shared;
  return buffer;
}

at::Tensor sum_grad_mask_copies(const at::Tensor& buffer, const at::Tensor& attn_mask) {
  return buffer.sum(0).view(attn_mask.sizes()).to(attn_mask.scalar_type());
}

// Common part of both backwards: dlse, seed, lse, dq/dk outputs, mask gradient.
struct BwdOutputs {
  at::Tensor grad_query, grad_key, grad_mask, mask_buffer, lse, grad_lse;
};

BwdOutputs make_backward_outputs(AttnBwdParams& p, const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
                                 const std::optional<at::Tensor>& attn_mask,
                                 const std::optional<at::Tensor>& dropout_seed, bool compute_grad_mask) {
  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  check_lse(lse, "lse", p, query);
  BwdOutputs o;
  o.grad_query = at::empty(query.sizes(), query.options());
  o.grad_key = at::empty(key.sizes(), key.options());
  advise_huge_pages(o.grad_query);
  advise_huge_pages(o.grad_key);
  o.grad_mask = at::empty({0}, query.options());
  o.lse = lse.contiguous();
  p.lse = o.lse.data_ptr();
  if (grad_lse.has_value()) {
    check_lse(*grad_lse, "grad_lse", p, query);
    o.grad_lse = grad_lse->contiguous();
    p.dlse = o.grad_lse.data_ptr();
  }
  read_seed(p, dropout_seed);
  p.dq = o.grad_query.data_ptr();
  p.dk = o.grad_key.data_ptr();
  copy_strides(p.dq_stride, o.grad_query);
  copy_strides(p.dk_stride, o.grad_key);
  if (compute_grad_mask) {
    TORCH_CHECK(attn_mask.has_value(), "attn_ext: compute_grad_mask needs a float attn_mask");
    o.mask_buffer = grad_mask_buffer(p, *attn_mask, acc);
  }
  return o;
}

// The forward of every op: the variants described in p, the keys no row sees
// cut (when given a cut to keep them in), the outputs allocated
// (make_forward_outputs), the kernel run. Returns {out or probs, lse}.
std::tuple<at::Tensor, at::Tensor> run_forward(AttnParams& p, Variants& variants, const at::Tensor& query, bool probs,
                                               const std::optional<at::Tensor>& dropout_seed, KeyCut* cut = nullptr) {
  describe_variants(p, variants, query);
  // after the variants: it may set the flags
  if (cut != nullptr) read_mask(p, *cut, probs ? KeyUse::KeepAll : KeyUse::Cut);
  auto [result, lse] = make_forward_outputs(p, query, probs);
  advise_huge_pages(result);
  if (lse.numel() == 0) return {result, lse};
  read_seed(p, dropout_seed);
  cpu::attention_forward(p);
  return {result, lse};
}

// The backward of the ops with a value (attention_backward, varlen_backward):
// the variants and grad_out described in p, the keys no row sees cut (as in
// run_forward), every gradient allocated, the kernel run, the mask's and the
// sinks' gradients summed.
struct ValueGrads {
  BwdOutputs o;
  at::Tensor grad_value, grad_sinks;
};
ValueGrads run_value_backward(AttnBwdParams& p, Variants& variants, const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& grad_out, const at::Tensor& out,
                              const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
                              const std::optional<at::Tensor>& attn_mask,
                              const std::optional<at::Tensor>& dropout_seed, bool compute_grad_mask,
                              KeyCut* cut = nullptr) {
  describe_variants(p, variants, query);
  if (cut != nullptr && !compute_grad_mask) read_mask(p, *cut);  // the mask's gradient needs it whole
  describe_grad_output(p, grad_out, out, query);
  ValueGrads g;
  g.o = make_backward_outputs(p, query, key, lse, grad_lse, attn_mask, dropout_seed, compute_grad_mask);
  at::Tensor dsinks = grad_sinks_buffer(p, variants, query);
  g.grad_value = at::empty(value.sizes(), value.options());
  advise_huge_pages(g.grad_value);
  if (p.B > 0 && p.Hq > 0) {
    p.dv = g.grad_value.data_ptr();
    copy_strides(p.dv_stride, g.grad_value);
    cpu::attention_backward(p);
  }
  if (compute_grad_mask) g.o.grad_mask = sum_grad_mask_copies(g.o.mask_buffer, *attn_mask);
  g.grad_sinks = grad_sinks_from(dsinks, variants, query);
  return g;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& query,   // (B, Hq, L, E)
    const at::Tensor& key,     // (B, Hkv, S, E)
    const at::Tensor& value,   // (B, Hkv, S, Ev)
    const std::optional<at::Tensor>& attn_mask,  // broadcastable to (B, Hq, L, S)
    double dropout_p, bool is_causal, int64_t causal_offset, double scale,
    const std::optional<at::Tensor>& dropout_seed,  // int64, 1 element
    std::optional<int64_t> window_left, std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes,  // float32 (Hq,) or (B, Hq)
    const std::optional<at::Tensor>& sinks) {       // (Hq,)
  AttnParams p = make_params(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  KeyCut cut;
  return run_forward(p, variants, query, /*probs=*/false, dropout_seed, &cut);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out,                 // (B, Hq, L, Ev), any strides
    const std::optional<at::Tensor>& grad_lse,  // (B, Hq, L), lse's dtype
    const at::Tensor& query,                    // (B, Hq, L, E)
    const at::Tensor& key,                      // (B, Hkv, S, E)
    const at::Tensor& value,                    // (B, Hkv, S, Ev)
    const at::Tensor& out,                      // (B, Hq, L, Ev), attention_forward's
    const at::Tensor& lse,                      // (B, Hq, L), attention_forward's
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, std::optional<int64_t> window_left,
    std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, bool compute_grad_mask) {
  AttnBwdParams p;
  static_cast<AttnParams&>(p) =
      make_params(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  const int64_t S = p.S;
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  KeyCut cut;
  ValueGrads g = run_value_backward(p, variants, query, key, value, grad_out, out, lse, grad_lse, attn_mask,
                                    dropout_seed, compute_grad_mask, &cut);
  // dK and dV of the keys no row sees (of the whole batch, or of each entry): 0
  auto zero_outside = [S](const at::Tensor& grad, int64_t begin, int64_t end) {
    if (begin > 0) grad.narrow(-2, 0, begin).zero_();
    if (end < S) grad.narrow(-2, end, S - end).zero_();
  };
  const std::vector<int64_t>& entries = cut.entries;
  for (const at::Tensor& grad : {g.o.grad_key, g.grad_value}) {
    if (entries.empty()) zero_outside(grad, p.key_begin, p.S);
    for (int64_t b = 0; b < int64_t(entries.size()) / 2; ++b) zero_outside(grad[b], entries[2 * b], entries[2 * b + 1]);
  }
  return {g.o.grad_query, g.o.grad_key, g.grad_value, g.o.grad_mask, g.grad_sinks};
}

std::tuple<at::Tensor, at::Tensor> attention_probs_cpu(
    const at::Tensor& query,  // (B, Hq, L, E)
    const at::Tensor& key,    // (B, Hkv, S, E)
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, std::optional<int64_t> window_left,
    std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
  AttnParams p = make_params(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  KeyCut cut;
  return run_forward(p, variants, query, /*probs=*/true, dropout_seed, &cut);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_probs_backward_cpu(
    const at::Tensor& grad_probs,               // (B, Hq, L, S), any strides
    const std::optional<at::Tensor>& grad_lse,  // (B, Hq, L)
    const at::Tensor& query,                    // (B, Hq, L, E)
    const at::Tensor& key,                      // (B, Hkv, S, E)
    const at::Tensor& probs,                    // (B, Hq, L, S), attention_probs'
    const at::Tensor& lse,                      // (B, Hq, L), attention_probs'
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, std::optional<int64_t> window_left,
    std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, bool compute_grad_mask) {
  AttnBwdParams p;
  static_cast<AttnParams&>(p) =
      make_params(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  describe_variants(p, variants, query);
  KeyCut cut;
  if (!compute_grad_mask) read_mask(p, cut, KeyUse::KeepAll);  // the forward's row ranges and flags
  describe_grad_probs(p, grad_probs, probs, query);
  BwdOutputs o = make_backward_outputs(p, query, key, lse, grad_lse, attn_mask, dropout_seed, compute_grad_mask);
  at::Tensor dsinks = grad_sinks_buffer(p, variants, query);
  if (p.B > 0 && p.Hq > 0) cpu::attention_backward(p);
  if (compute_grad_mask) o.grad_mask = sum_grad_mask_copies(o.mask_buffer, *attn_mask);
  return {o.grad_query, o.grad_key, o.grad_mask, grad_sinks_from(dsinks, variants, query)};
}

std::tuple<at::Tensor, at::Tensor> varlen_forward_cpu(
    const at::Tensor& query,         // (total_q, Hq, E), any strides
    const at::Tensor& key,           // (total_k, Hkv, E)
    const at::Tensor& value,         // (total_k, Hkv, Ev)
    const at::Tensor& cu_seqlens_q,  // (B + 1,) int32/int64
    const at::Tensor& cu_seqlens_k,  // (B + 1,)
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal, bool bottom_right, double scale,
    const std::optional<at::Tensor>& dropout_seed, std::optional<int64_t> window_left,
    std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes,  // float32 (Hq,) or (B, Hq)
    const std::optional<at::Tensor>& sinks) {       // (Hq,)
  PackedSeqlens cu;
  AttnParams p = make_varlen_params(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p, is_causal, bottom_right, scale, dropout_seed, cu);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  return run_forward(p, variants, query, /*probs=*/false, dropout_seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_backward_cpu(
    const at::Tensor& grad_out,                 // (total_q, Hq, Ev), any strides
    const std::optional<at::Tensor>& grad_lse,  // (total_q, Hq), lse's dtype
    const at::Tensor& query,                    // (total_q, Hq, E)
    const at::Tensor& key,                      // (total_k, Hkv, E)
    const at::Tensor& value,                    // (total_k, Hkv, Ev)
    const at::Tensor& out,                      // (total_q, Hq, Ev), varlen_forward's
    const at::Tensor& lse,                      // (total_q, Hq), varlen_forward's
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, bool is_causal, bool bottom_right, double scale, const std::optional<at::Tensor>& dropout_seed,
    std::optional<int64_t> window_left, std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
  PackedSeqlens cu;
  AttnBwdParams p;
  static_cast<AttnParams&>(p) = make_varlen_params(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                   max_seqlen_k, dropout_p, is_causal, bottom_right, scale,
                                                   dropout_seed, cu);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  ValueGrads g = run_value_backward(p, variants, query, key, value, grad_out, out, lse, grad_lse, std::nullopt,
                                    dropout_seed, false);
  return {g.o.grad_query, g.o.grad_key, g.grad_value, g.grad_sinks};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_forward", &attention_forward_cpu);
  m.impl("attention_backward", &attention_backward_cpu);
  m.impl("attention_probs", &attention_probs_cpu);
  m.impl("attention_probs_backward", &attention_probs_backward_cpu);
  m.impl("varlen_forward", &varlen_forward_cpu);
  m.impl("varlen_backward", &varlen_backward_cpu);
}

}  // namespace attn_ext
