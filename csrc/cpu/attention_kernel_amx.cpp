// attn_ext: the CPU kernels for bfloat16 units, two variants of one unit:
//   amx         (Sapphire Rapids and later) bfloat16 attention whose matrix
//               products run on AMX tiles (bfloat16 inputs, float32 accumulation);
//   avx512bf16  (AMD Zen 4 and later, Intel Cooper Lake) the same products with
//               AVX512-BF16 dot products on vector registers (amx_bf16.h's gemm_dots).
// Both run inside the same driver as every other variant. The amx variant also runs float16 on
// the tiles, in split bfloat16 (HalfSplitForwardProducts, HalfSplitBackwardProducts); every
// other dtype and shapes the products do not suit run avx512's kernels. Compiled with
// avx512's flags (isa_flags.txt); amx_bf16.h enables the AMX and AVX512-BF16
// instructions for its own functions only.
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define ATTN_EXT_KERNEL_NS AMX
#define ATTN_EXT_OWN_ENTRY_POINTS
#include "attention_kernel_impl.h"
#include "amx_bf16.h"

namespace attn_ext::cpu::AMX {
namespace {

using Bf16 = c10::BFloat16;

const uint16_t* bits(const Bf16* x) { return reinterpret_cast<const uint16_t*>(x); }

void zero_rows(uint16_t* a, int64_t ld, int64_t from, int64_t to) {
  if (to > from) std::fill(a + from * ld, a + to * ld, uint16_t(0));
}

// Rows [0, m) of a bfloat16 matrix (row stride ld, columns contiguous) as the A operand of
// products over mp rows (zero past m) and Kp columns (zero past K): read in place where that
// needs no padding, else copied into buf (mp x Kp).
struct ARows {
  const uint16_t* data;
  int64_t ld;
};

ARows a_operand(uint16_t* buf, const Bf16* rows, int64_t ld, int64_t m, int64_t mp, int64_t K, int64_t Kp) {
  if (m == mp && K == Kp && ld >= K) return ARows{bits(rows), ld};
  amx::copy_rows_bf16(buf, Kp, bits(rows), ld, m, K, Kp);
  zero_rows(buf, Kp, m, mp);
  return ARows{buf, Kp};
}

// Row i of head h of batch b of a float16 tensor, as raw bits.
const uint16_t* half_rows(const void* base, const int64_t (&stride)[4], int64_t b, int64_t h, int64_t i) {
  return reinterpret_cast<const uint16_t*>(row_at<c10::Half>(base, stride, b, h, i));
}

// Rows [0, m) of a float16 matrix x (`width` columns, row stride ldx) as split bfloat16 A rows
// [Xh | Xh | Xl | Xl] (amx_bf16.h; each part w32 wide, zero past width), zero in rows m..mp.
void split_a_rows(uint16_t* a, const uint16_t* x, int64_t ldx, int64_t m, int64_t mp, int64_t width, int64_t w32) {
  const int64_t ld = 4 * w32;
  amx::split_rows_from_f16(a, ld, a + 2 * w32, ld, x, ldx, m, width, w32);
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(a + r * ld + w32, a + r * ld, w32 * sizeof(uint16_t));
    std::memcpy(a + r * ld + 3 * w32, a + r * ld + 2 * w32, w32 * sizeof(uint16_t));
  }
  zero_rows(a, ld, m, mp);
}

// fn(r0, rows, begin, end) for each block of `block` rows of the mp (padded) rows of a
// band's tile whose columns (band_columns, widened to `align`) meet [c, c_end), with
// [begin, end) what they share: the row blocks of the products over a band.
template <typename Fn>
void for_band_blocks(int64_t mp, int64_t block, int64_t first, int64_t reach, int64_t n, int64_t align, int64_t c,
                     int64_t c_end, Fn&& fn) {
  for (int64_t r0 = 0; r0 < mp; r0 += block) {
    const int64_t rows = std::min(block, mp - r0);
    const KeyRange band = band_columns(first, reach, r0, r0 + rows, n, align);
    const int64_t begin = std::max(band.begin, c), end = std::min(band.end, c_end);
    if (end > begin) fn(r0, rows, begin, end);
  }
}
constexpr int64_t kAllColumns = int64_t(1) << 60;

// The products' two engines: one interface (amx::gemm's), with its per-thread set-up.
struct TileEngine {  // AMX-BF16 tiles: the tile configuration is per-thread state
  static constexpr int64_t kBandRows = 32;  // its products run 32 x 32 blocks of C (four tiles)
  static void start() { amx::configure_tiles(); }
  static void stop() { amx::release_tiles(); }
  static void gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t ldb,
                   float* C, int64_t ldc, bool accumulate) {
    amx::gemm(M, N, K, A, lda, Bv, ldb, C, ldc, accumulate);
  }
};

struct DotEngine {  // AVX512-BF16 dot products: no state
  static constexpr int64_t kBandRows = 16;  // the smallest M gemm_dots takes
  static void start() {}
  static void stop() {}
  static void gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t ldb,
                   float* C, int64_t ldc, bool accumulate) {
    amx::gemm_dots(M, N, K, A, lda, Bv, ldb, C, ldc, accumulate);
  }
};

// What the forward's products on an engine (VecForwardProducts' interface) share: Q the A operand
// as bfloat16 rows, unscaled (the driver applies the scale to the float32 scores, unscaled());
// whole 16-row A tiles; keys 32 at a time; K^T and V of a (batch, kv head) packed once into VNNI
// panels of `panel` keys (k_parts and v_parts bfloat16 values per element) and kept while they
// fit (PanelCache); the engine's per-thread set-up. Both products skip what lies outside the query
// block's band (causal bound, window), Engine::kBandRows rows at a time.
template <class Engine>
class TileForwardBase {
 public:
  using T = float;
  static constexpr int64_t kCols = 16;      // a C tile is 16 floats wide
  static constexpr int64_t kKeyAlign = 32;  // P V takes keys 32 at a time (one A tile's depth)
  static constexpr int64_t kRowAlign = 16;  // query blocks are whole A tiles
  static float unscaled(const AttnParams& p) { return static_cast<float>(p.scale); }  // S is Q K^T

  int64_t out_ld() const { return Evp_; }
  void bind(const AttnParams& p) { p_ = &p; }

 protected:
  TileForwardBase(const AttnParams& p, int64_t panel, int64_t k_parts, int64_t v_parts)
      : p_(&p), E_(p.E), Ep_(round_up(p.E, 32)), Evp_(round_up(std::max<int64_t>(p.Ev, 1), 16)), panel_(panel),
        k_panel_(k_parts * Ep_ * panel), v_panel_(v_parts * panel * Evp_) {
    cache_.blocks = ceil_div(std::max<int64_t>(p.S, 1), panel);
    cache_.on = (k_panel_ + v_panel_) * cache_.blocks * 2 <= kKeyCacheBytes;
    const int64_t slots = cache_.on ? cache_.blocks : 1;
    kv_.resize(k_panel_ * slots);
    if (p.v != nullptr) vv_.resize(v_panel_ * slots);
    Engine::start();
  }
  ~TileForwardBase() { Engine::stop(); }

  // The K^T (V) panel of kv head hk that starts at key j0 (on the panel grid); pack(dst, keys)
  // fills it the first time (keys: those the panel holds).
  template <class Pack>
  uint16_t* k_panel(int64_t b, int64_t hk, int64_t j0, Pack&& pack) {
    return panel(kv_, k_panel_, cache_.k, b, hk, j0, pack);
  }
  template <class Pack>
  uint16_t* v_panel(int64_t b, int64_t hk, int64_t j0, Pack&& pack) {
    return panel(vv_, v_panel_, cache_.v, b, hk, j0, pack);
  }

  void set_rows(int64_t m) {
    m_ = m;
    mp_ = round_up(m, 16);
  }

  static constexpr int64_t kBand = Engine::kBandRows;
  const AttnParams* p_;
  const int64_t E_, Ep_, Evp_, panel_, k_panel_, v_panel_;
  int64_t m_ = 0, mp_ = 0;  // the query block's rows, and as whole A tiles

 private:
  template <class Pack>
  uint16_t* panel(Buffer<uint16_t>& buf, int64_t size, std::vector<bool>& marks, int64_t b, int64_t hk, int64_t j0,
                  Pack& pack) {
    const int64_t slot = cache_.slot(b * p_->Hkv + hk, j0 / panel_);
    uint16_t* dst = buf.data() + slot * size;
    if (!cache_.packed(marks, slot)) {  // the whole panel, whatever part of it this query block sees
      pack(dst, std::min(panel_, p_->S - j0));
      cache_.mark(marks, slot);
    }
    return dst;
  }

  PanelCache cache_;
  Buffer<uint16_t> kv_, vv_;
};

// bfloat16's forward products: Q read in place as A rows where it needs no padding (a_operand);
// each row of P rounded to bfloat16 for P V.
template <class Engine>
class Bf16ForwardProducts : public TileForwardBase<Engine> {
  using Base = TileForwardBase<Engine>;
  using Base::E_, Base::Ep_, Base::Evp_, Base::kBand, Base::m_, Base::mp_, Base::p_, Base::panel_;

 public:
  Bf16ForwardProducts(const AttnParams& p, int64_t q_block, int64_t panel, int64_t cols) : Base(p, panel, 1, 1) {
    qa_.resize(q_block * Ep_);
    pa_.resize(q_block * cols);
  }

  void load_q(int64_t b, int64_t h, int64_t i0, int64_t m) {
    this->set_rows(m);
    q_ = a_operand(qa_.data(), row_at<Bf16>(p_->q, p_->q_stride, b, h, i0), p_->q_stride[2], m, mp_, E_, Ep_);
  }

  // S = Q K[j0, j0 + n)^T, a product per panel (j0 on a panel boundary), each block of rows
  // over the columns of the panel its band holds (band_columns; the rest is left unwritten).
  void scores(float* st, int64_t ld, int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t reach, int64_t first) {
    for (int64_t c = 0; c < n; c += panel_) {
      const uint16_t* kv = this->k_panel(b, hk, j0 + c, [&](uint16_t* dst, int64_t keys) {
        const Bf16* k_tile = row_at<Bf16>(p_->k, p_->k_stride, b, hk, j0 + c);
        amx::pack_vnni_from_transposed(dst, bits(k_tile), p_->k_stride[2], keys, E_, Ep_, panel_);
      });
      const int64_t c_end = std::min(c + panel_, ld);  // the last panel's columns up to ld
      for_band_blocks(mp_, kBand, first, reach, n, 16, c, c_end, [&](int64_t r0, int64_t rows, int64_t begin,
                                                                       int64_t end) {
        Engine::gemm(rows, end - begin, Ep_, q_.data + r0 * q_.ld, q_.ld, kv + 2 * (begin - c), 2 * panel_,
                     st + r0 * ld + begin, ld, false);
      });
    }
  }

  // Row r of P, rounded to bfloat16 while it is in L1 (the A operand of P V).
  void take_p_row(int64_t r, const float* s, int64_t n) {
    const int64_t n32 = round_up(n, 32);
    amx::convert_rows_to_bf16(pa_.data() + r * n32, n32, s, n32, 1, n, n32);
  }

  // O += P V, each block of rows over the keys its band holds (P is 0 past them), 32 at a time.
  void add_pv(float* ot, const float*, int64_t, int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t reach,
              int64_t first) {
    const int64_t n32 = round_up(n, 32);
    zero_rows(pa_.data(), n32, m_, mp_);  // rows 0..m come from take_p_row
    for (int64_t c = 0; c < n; c += panel_) {
      const uint16_t* vv = this->v_panel(b, hk, j0 + c, [&](uint16_t* dst, int64_t keys) {
        const Bf16* v_tile = row_at<Bf16>(p_->v, p_->v_stride, b, hk, j0 + c);
        amx::pack_vnni_from_rows(dst, bits(v_tile), p_->v_stride[2], keys, p_->Ev, panel_, Evp_);
      });
      const int64_t c_end = std::min(c + panel_, n32);
      for_band_blocks(mp_, kBand, first, reach, n, 32, c, c_end, [&](int64_t r0, int64_t rows, int64_t begin,
                                                                       int64_t end) {
        Engine::gemm(rows, Evp_, end - begin, pa_.data() + r0 * n32 + begin, n32, vv + (begin - c) * Evp_, 2 * Evp_,
                     ot + r0 * Evp_, Evp_, true);
      });
    }
  }

 private:
  ARows q_{};
  Buffer<uint16_t> qa_, pa_;
};

// float16's forward products on the same engine, in split bfloat16 (amx_bf16.h): each float16
// value of Q, K and V is exactly hi + lo, two bfloat16 values, and each row of P (fp32) is split
// the same way to 2^-17 of itself.
//   S = [Qh | Qh] [Kh; Kl] + [Ql | Ql] [Kh; Kl]: two products over 2 Ep columns, the K^T panels
//       packed once as [Kh; Kl] (A rows [Qh | Qh | Ql | Ql]). fp32 sums of exact products, as
//       with float32 FMA on avx512's kernels (which convert every value to fp32): the scores and
//       the log-sum-exp keep float32's accuracy. (Without Ql Kl, up to 2^-18 of each product,
//       a row that sees one key got 2.9e-6 relative in its log-sum-exp against PyTorch's
//       1.3e-7 in float32.) Panels of [Kh; Kh; Kl; Kl] for one product over 4 Ep columns
//       measured slower (1.4x SDPA against 1.8x at 1 x 8 x 4096 x 64 on the Xeon): twice the
//       bytes per key to stream from L3 for each query block.
//   O += Ph Vh + Pl Vh + Ph Vl: three products over the same keys. Pl Vl is left out: at most
//       2^-18 of each product, far below the float16 output's rounding (2^-11).
// Only on the tiles: on the dot engine (Zen 4) a bfloat16 dot product does two multiply-adds
// per lane to an fp32 FMA's one, so the seven products would take 3.5 instructions' worth
// where avx512's kernels take 2 (reasoned, not measured: no Zen 4 at hand when this was written).
template <class Engine>
class HalfSplitForwardProducts : public TileForwardBase<Engine> {
  using Base = TileForwardBase<Engine>;
  using Base::E_, Base::Ep_, Base::Evp_, Base::kBand, Base::m_, Base::mp_, Base::p_, Base::panel_;

 public:
  HalfSplitForwardProducts(const AttnParams& p, int64_t q_block, int64_t panel, int64_t cols)
      : Base(p, panel, 2, 2) {
    qa_.resize(q_block * 4 * Ep_);
    p_hi_.resize(q_block * cols);
    p_lo_.resize(q_block * cols);
    rows_.resize(panel * 2 * std::max(Ep_, Evp_));  // a panel's K rows split, or V's
  }

  // A rows [Qh | Qh | Ql | Ql], zero past E in each part and in rows m..mp.
  void load_q(int64_t b, int64_t h, int64_t i0, int64_t m) {
    this->set_rows(m);
    split_a_rows(qa_.data(), half_rows(p_->q, p_->q_stride, b, h, i0), p_->q_stride[2], m, mp_, E_, Ep_);
  }

  void scores(float* st, int64_t ld, int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t reach, int64_t first) {
    const int64_t K = 2 * Ep_, lda = 4 * Ep_;
    for (int64_t c = 0; c < n; c += panel_) {
      const uint16_t* kv = this->k_panel(b, hk, j0 + c, [&](uint16_t* dst, int64_t keys) {
        // K's rows as [Kh | Kl] (the panel's K^T: [Kh; Kl])
        uint16_t* rows = rows_.data();
        amx::split_rows_from_f16(rows, K, rows + Ep_, K, half_rows(p_->k, p_->k_stride, b, hk, j0 + c),
                                 p_->k_stride[2], keys, E_, Ep_);
        amx::pack_vnni_from_transposed(dst, rows, K, keys, K, K, panel_);
      });
      const int64_t c_end = std::min(c + panel_, ld);
      for_band_blocks(mp_, kBand, first, reach, n, 16, c, c_end, [&](int64_t r0, int64_t rows, int64_t begin,
                                                                       int64_t end) {
        const uint16_t* a = qa_.data() + r0 * lda;
        float* s = st + r0 * ld + begin;
        Engine::gemm(rows, end - begin, K, a, lda, kv + 2 * (begin - c), 2 * panel_, s, ld, false);
        Engine::gemm(rows, end - begin, K, a + K, lda, kv + 2 * (begin - c), 2 * panel_, s, ld, true);
      });
    }
  }

  // Row r of P split while it is in L1 (zero past n).
  void take_p_row(int64_t r, const float* s, int64_t n) {
    const int64_t n32 = round_up(n, 32);
    amx::split_rows_from_f32(p_hi_.data() + r * n32, n32, p_lo_.data() + r * n32, n32, s, n32, 1, n, n32);
  }

  void add_pv(float* ot, const float*, int64_t, int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t reach,
              int64_t first) {
    const int64_t n32 = round_up(n, 32), vp = panel_ * Evp_;
    zero_rows(p_hi_.data(), n32, m_, mp_);
    zero_rows(p_lo_.data(), n32, m_, mp_);
    for (int64_t c = 0; c < n; c += panel_) {
      const uint16_t* v_hi = this->v_panel(b, hk, j0 + c, [&](uint16_t* dst, int64_t keys) {
        uint16_t* hi = rows_.data();
        uint16_t* lo = hi + vp;
        amx::split_rows_from_f16(hi, Evp_, lo, Evp_, half_rows(p_->v, p_->v_stride, b, hk, j0 + c),
                                 p_->v_stride[2], keys, p_->Ev, Evp_);
        amx::pack_vnni_from_rows(dst, hi, Evp_, keys, p_->Ev, panel_, Evp_);
        amx::pack_vnni_from_rows(dst + vp, lo, Evp_, keys, p_->Ev, panel_, Evp_);
      });
      const uint16_t* v_lo = v_hi + vp;
      const int64_t c_end = std::min(c + panel_, n32);
      for_band_blocks(mp_, kBand, first, reach, n, 32, c, c_end, [&](int64_t r0, int64_t rows, int64_t begin,
                                                                       int64_t end) {
        const int64_t at = r0 * n32 + begin;
        const uint16_t* vh = v_hi + (begin - c) * Evp_;
        const uint16_t* vl = v_lo + (begin - c) * Evp_;
        float* o = ot + r0 * Evp_;
        Engine::gemm(rows, Evp_, end - begin, p_hi_.data() + at, n32, vh, 2 * Evp_, o, Evp_, true);
        Engine::gemm(rows, Evp_, end - begin, p_lo_.data() + at, n32, vh, 2 * Evp_, o, Evp_, true);
        Engine::gemm(rows, Evp_, end - begin, p_hi_.data() + at, n32, vl, 2 * Evp_, o, Evp_, true);
      });
    }
  }

 private:
  Buffer<uint16_t> qa_, p_hi_, p_lo_, rows_;
};

// Decoding's products (VecForwardProducts' interface) for a query block of
// kDotRows rows or fewer, where packing keys for tiles costs more than the
// product: each key and value row is read in place as bfloat16 and multiplied
// with AVX512-BF16 dot products (float32 sums of exact bfloat16 products), Q
// kept as bfloat16 rows, unscaled, as on the tiles. Each row of P is rounded
// to bfloat16 for P V, as on the tiles.
class Bf16DotProducts {
 public:
  using T = float;
  static constexpr int64_t kCols = 16;      // S and O rows are padded to whole vectors
  static constexpr int64_t kKeyAlign = 16;  // key blocks too
  static constexpr int64_t kRowAlign = 1;   // query blocks of any height (up to kDotRows here)
  static float unscaled(const AttnParams& p) { return static_cast<float>(p.scale); }  // S is Q K^T

  Bf16DotProducts(const AttnParams& p, int64_t q_block, int64_t /*panel*/, int64_t cols)
      : p_(&p), E_(p.E), Ep_(round_up(std::max<int64_t>(p.E, 1), 32)), Evp_(round_up(std::max<int64_t>(p.Ev, 1), 16)),
        lp_(round_up(cols, 32)) {
    qa_.resize(q_block * Ep_);
    pa_.resize(q_block * lp_);
  }

  int64_t out_ld() const { return Evp_; }
  void bind(const AttnParams& p) { p_ = &p; }

  void load_q(int64_t b, int64_t h, int64_t i0, int64_t m) {
    m_ = m;
    amx::copy_rows_bf16(qa_.data(), Ep_, bits(row_at<Bf16>(p_->q, p_->q_stride, b, h, i0)), p_->q_stride[2], m, E_,
                        Ep_);
  }

  void scores(float* st, int64_t ld, int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t /*reach*/,
              int64_t /*first*/) {
    amx::dot_rows_bf16(st, ld, qa_.data(), Ep_, m_, bits(row_at<Bf16>(p_->k, p_->k_stride, b, hk, j0)),
                       p_->k_stride[2], n, E_);
    for (int64_t r = 0; r < m_; ++r) std::fill(st + r * ld + n, st + (r + 1) * ld, 0.f);
  }

  // Row r of P, rounded to bfloat16 (zero past n, so that keys pair up).
  void take_p_row(int64_t r, const float* s, int64_t n) {
    amx::convert_rows_to_bf16(pa_.data() + r * lp_, lp_, s, lp_, 1, n, round_up(n, 2));
  }

  void add_pv(float* ot, const float*, int64_t, int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t /*reach*/,
              int64_t /*first*/) {
    amx::add_pv_rows_bf16(ot, Evp_, pa_.data(), lp_, m_, bits(row_at<Bf16>(p_->v, p_->v_stride, b, hk, j0)),
                          p_->v_stride[2], n, p_->Ev);
  }

 private:
  const AttnParams* p_;
  const int64_t E_, Ep_, Evp_, lp_;
  int64_t m_ = 0;
  Buffer<uint16_t> qa_, pa_;
};

// What the backward's products on an engine (VecBackwardProducts' interface) share: S = Q K^T
// comes unscaled (the driver scales it); dQ and dK are stored times the scale. A key block's
// keys, narrowed to those the query block sees and of those to the band each row sees
// (narrow()); every product skips the blocks outside it: the row blocks of S, dP and dQ
// (for_row_blocks), the key blocks of dV and dK (for_key_blocks).
template <class Engine>
class TileBackwardBase {
 public:
  using T = float;
  static constexpr int64_t kCols = 16;
  static constexpr int64_t kKeyAlign = 32;
  static float unscaled(const AttnParams& p) { return static_cast<float>(p.scale); }
  static float dq_scale(const AttnParams& p) { return static_cast<float>(p.scale); }
  static float dk_scale(const AttnParams& p) { return static_cast<float>(p.scale); }

  void bind(const AttnBwdParams& p) { p_ = &p; }

  // dK and dV as the products sum them, as keys' columns (dK^T += Q^T dS, dV^T += dO^T Z: width
  // rows ld_keys() apart), turned back into the first n keys' rows (width apart) once per key block.
  // Summing dK = dS^T Q as rows needs dS^T and Z^T as A operands, transposed from every (query
  // block, key block) pair's float32 tiles: 13-17 % of a bfloat16 backward on the Xeon (model 167).
  const float* key_rows(const float* acc, int64_t width, int64_t n) {
    amx::transpose_f32(key_rows_.data(), width, acc, ld_keys(), width, n);
    return key_rows_.data();
  }

  // The next products take only the first n keys of the loaded block (the query block sees no
  // more), and of those only the band row r sees, [first + r, reach + r) (band_columns), in
  // blocks of Engine::kBandRows: S and dP are left unwritten outside it, and the driver makes
  // P and dS 0 there.
  void narrow(int64_t n, int64_t reach, int64_t first) {
    n_ = n;
    n16_ = round_up(n, 16);
    n32_ = round_up(n, 32);
    reach_ = reach;
    first_ = first;
  }

 protected:
  TileBackwardBase(const AttnBwdParams& p, int64_t kv_block)
      : p_(&p), E_(p.E), Ev_(p.Ev), Ep16_(round_up(std::max<int64_t>(p.E, 1), 16)), Ep32_(round_up(p.E, 32)),
        Evp16_(round_up(std::max<int64_t>(p.Ev, 1), 16)), Evp32_(round_up(p.Ev, 32)), kv_block_(kv_block),
        from_probs_(p.dprobs != nullptr) {
    Engine::start();
    key_rows_.resize(kv_block * std::max(Ep16_, Evp16_));
  }
  ~TileBackwardBase() { Engine::stop(); }

  void start_key_block(int64_t n) {
    narrow(n, -kOpenFirst, kOpenFirst);  // both sides open
    ld16_ = n16_;  // the row stride of the driver's score tiles
  }
  void set_rows(int64_t m) {
    m_ = m;
    m16_ = round_up(m, 16);
    m32_ = round_up(m, 32);
  }

  // fn(r0, rows, begin, end): each block of rows over the keys its band sees, widened to `align`.
  template <class Fn>
  void for_row_blocks(int64_t align, Fn&& fn) const {
    for_band_blocks(m16_, kBand, first_, reach_, n_, align, 0, kAllColumns, fn);
  }
  // fn(c0, keys, begin, end): each block of keys over the rows [begin, end) that see it (32 at a time).
  template <class Fn>
  void for_key_blocks(Fn&& fn) const {
    for (int64_t c0 = 0; c0 < n16_; c0 += kBand) {
      const int64_t keys = std::min(kBand, n16_ - c0);
      const KeyRange rows = band_rows(first_, reach_, c0, c0 + keys, m_, 32);
      if (rows.end > rows.begin) fn(c0, keys, rows.begin, rows.end);
    }
  }

  // x_t (width x m32 bf16) = the transpose of the block's rows X, given as their VNNI panel
  // (m32 / 2 rows of 2 width: pairs of rows as 32-bit words), whose 32-bit transpose X^T is.
  void transpose_row_panel(uint16_t* x_t, const uint16_t* vnni, int64_t width) const {
    amx::pack_vnni_from_transposed(x_t, vnni, 2 * width, m32_ / 2, 2 * width, 2 * width, m32_ / 2);
  }

  // c (M x n16, row stride ld_keys) += the sum of x_t y over the terms: x_t (M x m32 bf16 rows, a
  // block of rows transposed) and y (a VNNI panel of the block's rows of Z or dS, ld_panel apart,
  // its rows past m zeroed: zero_panel_padding), each block of keys over the rows that see it.
  struct KeyTerm {
    const uint16_t* x_t;
    const uint16_t* y;
  };
  template <size_t N>
  void key_products(float* c, int64_t M, const KeyTerm (&terms)[N]) const {
    for_key_blocks([&](int64_t c0, int64_t keys, int64_t begin, int64_t end) {
      for (const KeyTerm& t : terms)
        Engine::gemm(M, keys, end - begin, t.x_t + begin, m32_, t.y + (begin / 2) * ld_panel() + 2 * c0, ld_panel(),
                     c + c0, ld_keys(), true);
    });
  }
  void zero_panel_padding(uint16_t* y) const { amx::zero_vnni_rows(y, ld_panel(), m_, m32_, n16_); }

  // Elements of a VNNI panel of q_block rows of Z or dS (the B operands of dV^T and dK^T, written
  // row by row as the driver finishes them: finish_row), at ld_panel() for kv_block keys.
  static int64_t panel_size(int64_t q_block, int64_t kv_block) {
    return round_up(q_block, 32) / 2 * (2 * kv_block + 32);
  }
  // Those panels' row stride: a cache line past a power of two, so that a tile's rows do not share
  // the cache's sets (at 1 KiB the products ran about 10 % slower).
  int64_t ld_panel() const { return 2 * n16_ + 32; }
  // The same for dK^T and dV^T (kv_block_ keys, 16 more in the driver's buffers).
  int64_t ld_keys() const { return kv_block_ + 16; }

  static constexpr int64_t kBand = Engine::kBandRows;
  const AttnBwdParams* p_;
  const int64_t E_, Ev_, Ep16_, Ep32_, Evp16_, Evp32_, kv_block_;
  const bool from_probs_;
  int64_t m_ = 0, m16_ = 0, m32_ = 0, n_ = 0, n16_ = 0, n32_ = 0, ld16_ = 0, reach_ = 0, first_ = 0;
  Buffer<float> key_rows_;
};

#define ATTN_EXT_TILE_BACKWARD_BASE                                                                          \
  using Base = TileBackwardBase<Engine>;                                                                     \
  using Base::E_, Base::Ev_, Base::Ep16_, Base::Ep32_, Base::Evp16_, Base::Evp32_, Base::kv_block_,           \
      Base::from_probs_, Base::m_, Base::m16_, Base::m32_, Base::n_, Base::n16_, Base::n32_, Base::ld16_,     \
      Base::p_, Base::panel_size, Base::ld_panel, Base::ld_keys, Base::transpose_row_panel,                   \
      Base::key_products, Base::zero_panel_padding

// bfloat16's backward products: Q and dO kept unscaled as bfloat16 A rows (read in place where
// they need no padding, a_operand) for S and dP, and transposed (Q^T, dO^T: the A operands of
// dK^T and dV^T, whose sums run over the query rows); K^T, V^T and K of a key block as VNNI
// panels. Each row of Z and dS, once the driver has finished it (finish_row), is rounded to
// bfloat16 into VNNI panels of the rows for dV^T += dO^T Z and dK^T += Q^T dS (summed as keys'
// columns, turned back into keys' rows once per key block: key_rows), and dS into bfloat16 rows
// for dQ += dS K.
template <class Engine>
class Bf16BackwardProducts : public TileBackwardBase<Engine> {
  ATTN_EXT_TILE_BACKWARD_BASE;

 public:
  Bf16BackwardProducts(const AttnBwdParams& p, int64_t q_block, int64_t kv_block) : Base(p, kv_block) {
    const int64_t qb32 = round_up(q_block, 32);
    k_t_.resize(Ep32_ * kv_block);
    v_t_.resize(Evp32_ * kv_block);
    k_r_.resize(kv_block * Ep16_);
    q_a_.resize(q_block * Ep32_);
    do_a_.resize(q_block * Evp32_);
    q_r_.resize(qb32 * Ep16_);
    do_r_.resize(qb32 * Evp16_);
    q_t_.resize(Ep16_ * qb32);
    do_t_.resize(Evp16_ * qb32);
    z_panel_.resize(panel_size(q_block, kv_block));
    ds_panel_.resize(panel_size(q_block, kv_block));
    d_a_.resize(q_block * kv_block);
  }

  void load_kv(int64_t b, int64_t hk, int64_t j0, int64_t n) {
    this->start_key_block(n);
    const Bf16* k_tile = row_at<Bf16>(p_->k, p_->k_stride, b, hk, j0);
    amx::pack_vnni_from_transposed(k_t_.data(), bits(k_tile), p_->k_stride[2], n, E_, Ep32_, kv_block_);
    amx::pack_vnni_from_rows(k_r_.data(), bits(k_tile), p_->k_stride[2], n, E_, kv_block_, Ep16_);
    if (from_probs_) return;
    const Bf16* v_tile = row_at<Bf16>(p_->v, p_->v_stride, b, hk, j0);
    amx::pack_vnni_from_transposed(v_t_.data(), bits(v_tile), p_->v_stride[2], n, Ev_, Evp32_, kv_block_);
  }

  void load_q(int64_t b, int64_t h, int64_t i0, int64_t m) {
    this->set_rows(m);
    const Bf16* q_rows = row_at<Bf16>(p_->q, p_->q_stride, b, h, i0);
    q_ = a_operand(q_a_.data(), q_rows, p_->q_stride[2], m, m16_, E_, Ep32_);
    transposed_rows(q_t_.data(), q_r_.data(), q_rows, p_->q_stride[2], E_, Ep16_);
    if (from_probs_) return;
    const Bf16* do_rows = row_at<Bf16>(p_->dout, p_->do_stride, b, h, i0);
    do_ = a_operand(do_a_.data(), do_rows, p_->do_stride[2], m, m16_, Ev_, Evp32_);
    transposed_rows(do_t_.data(), do_r_.data(), do_rows, p_->do_stride[2], Ev_, Evp16_);
  }

  void scores(float* st) { band_products(st, q_, Ep32_, k_t_.data()); }

  void grad_probs(float* dst) { band_products(dst, do_, Evp32_, v_t_.data()); }

  // Row r of the query block's Z (its P when there is no dropout) and dS, final, n16 values each.
  void finish_row(int64_t r, const float* z, const float* ds) {
    if (!from_probs_) amx::vnni_row_from_f32(z_panel_.data() + (r / 2) * ld_panel(), r, z, n_, n16_);
    amx::vnni_row_from_f32(ds_panel_.data() + (r / 2) * ld_panel(), r, ds, n_, n16_);
    amx::convert_rows_to_bf16(d_a_.data() + r * n32_, n32_, ds, 0, 1, n_, n32_);
  }

  // dv^T (Evp16 rows, ld_keys() apart) += dO^T bf16(Z), Z's rows given to finish_row
  void add_dv(float* dv, const float*) {
    zero_panel_padding(z_panel_.data());
    key_products(dv, Evp16_, {{do_t_.data(), z_panel_.data()}});
  }

  // dq += bf16(dS) K, each block of rows over the keys it sees (32 at a time: the products' depth).
  void add_dq(float* dq, const float*) {
    zero_rows(d_a_.data(), n32_, m_, m16_);
    this->for_row_blocks(32, [&](int64_t r0, int64_t rows, int64_t begin, int64_t end) {
      Engine::gemm(rows, Ep16_, end - begin, d_a_.data() + r0 * n32_ + begin, n32_, k_r_.data() + begin * Ep16_,
                   2 * Ep16_, dq + r0 * Ep16_, Ep16_, true);
    });
  }

  // dk^T (Ep16 rows, ld_keys() apart) += Q^T bf16(dS)
  void add_dk(float* dk, const float*) {
    zero_panel_padding(ds_panel_.data());
    key_products(dk, Ep16_, {{q_t_.data(), ds_panel_.data()}});
  }

 private:
  // c (m16 x n16, row stride ld16) = a (m16 x K bf16 rows) bv (K x n16, a VNNI panel of the
  // block's keys), each block of rows over its band's columns only.
  void band_products(float* c, ARows a, int64_t K, const uint16_t* bv) {
    this->for_row_blocks(16, [&](int64_t r0, int64_t rows, int64_t begin, int64_t end) {
      Engine::gemm(rows, end - begin, K, a.data + r0 * a.ld, a.ld, bv + 2 * begin, 2 * kv_block_,
                   c + r0 * ld16_ + begin, ld16_, false);
    });
  }

  // x_t (width x m32 bf16, zero past the block's m rows) = X^T for the block's rows of X (cols wide,
  // row stride ld): the rows as a VNNI panel in vnni (pairs of rows as 32-bit words), whose 32-bit
  // transpose is X^T.
  void transposed_rows(uint16_t* x_t, uint16_t* vnni, const Bf16* rows, int64_t ld, int64_t cols, int64_t width) {
    amx::pack_vnni_from_rows(vnni, bits(rows), ld, m_, cols, m32_, width);
    transpose_row_panel(x_t, vnni, width);
  }

  ARows q_{}, do_{};  // the query block's Q and dO rows as A operands
  Buffer<uint16_t> k_t_, v_t_, k_r_, q_a_, do_a_, q_r_, do_r_, q_t_, do_t_, z_panel_, ds_panel_, d_a_;
};

// float16's backward products on the same engine, in split bfloat16 as the forward's
// (HalfSplitForwardProducts): S = Q K^T and dP = dO V^T take all four partial products (two
// tile products each over panels packed as [Kh; Kl] and [Vh; Vl], A rows [Xh | Xh | Xl | Xl]),
// so that dS = P (dP - D) starts from float32-accurate terms; dQ += dS K, dV^T += dO^T Z and
// dK^T += Q^T dS three (lo x lo left out, under 2^-18 of a product). As in Bf16BackwardProducts,
// dV and dK are summed as keys' columns: each finished row of Z and dS is split into VNNI panels
// of the rows (finish_row), Q^T and dO^T (hi and lo) come from their rows' VNNI panels by the
// 32-bit transpose, and dK^T and dV^T turn back into rows once per key block (key_rows). Summed
// as rows, the split Z^T and dS^T transposed from the finished tiles took 12 % of the samples of
// causal 1 x 8 x 4096 x 64 float16 backward calls (Xeon model 167).
template <class Engine>
class HalfSplitBackwardProducts : public TileBackwardBase<Engine> {
  ATTN_EXT_TILE_BACKWARD_BASE;

 public:
  HalfSplitBackwardProducts(const AttnBwdParams& p, int64_t q_block, int64_t kv_block) : Base(p, kv_block) {
    const int64_t qb32 = round_up(q_block, 32);
    rows_.resize(kv_block * 2 * std::max(Ep32_, Evp32_));
    k_t_.resize(2 * Ep32_ * kv_block);
    v_t_.resize(2 * Evp32_ * kv_block);
    k_rh_.resize(kv_block * Ep16_);
    k_rl_.resize(kv_block * Ep16_);
    q_a_.resize(qb32 * 4 * Ep32_);
    do_a_.resize(qb32 * 4 * Evp32_);
    const int64_t w16 = std::max(Ep16_, Evp16_);
    rh_.resize(qb32 * w16);
    rl_.resize(qb32 * w16);
    q_th_.resize(Ep16_ * qb32);
    q_tl_.resize(Ep16_ * qb32);
    do_th_.resize(Evp16_ * qb32);
    do_tl_.resize(Evp16_ * qb32);
    for (auto* panel : {&z_hi_, &z_lo_, &ds_hi_, &ds_lo_}) panel->resize(panel_size(q_block, kv_block));
    d_hi_.resize(q_block * kv_block);
    d_lo_.resize(q_block * kv_block);
  }

  void load_kv(int64_t b, int64_t hk, int64_t j0, int64_t n) {
    this->start_key_block(n);
    // K's rows split ([Kh | Kl], row stride 2 Ep32): the K^T panel [Kh; Kl] and K's rows as VNNI panels
    const int64_t kw = 2 * Ep32_;
    uint16_t* rows = rows_.data();
    amx::split_rows_from_f16(rows, kw, rows + Ep32_, kw, half_rows(p_->k, p_->k_stride, b, hk, j0), p_->k_stride[2],
                             n, E_, Ep32_);
    amx::pack_vnni_from_transposed(k_t_.data(), rows, kw, n, kw, kw, kv_block_);
    amx::pack_vnni_from_rows(k_rh_.data(), rows, kw, n, E_, kv_block_, Ep16_);
    amx::pack_vnni_from_rows(k_rl_.data(), rows + Ep32_, kw, n, E_, kv_block_, Ep16_);
    if (from_probs_) return;
    const int64_t vw = 2 * Evp32_;
    amx::split_rows_from_f16(rows, vw, rows + Evp32_, vw, half_rows(p_->v, p_->v_stride, b, hk, j0),
                             p_->v_stride[2], n, Ev_, Evp32_);
    amx::pack_vnni_from_transposed(v_t_.data(), rows, vw, n, vw, vw, kv_block_);
  }

  void load_q(int64_t b, int64_t h, int64_t i0, int64_t m) {
    this->set_rows(m);
    load_rows(q_a_.data(), q_th_.data(), q_tl_.data(), half_rows(p_->q, p_->q_stride, b, h, i0), p_->q_stride[2], E_,
              Ep32_, Ep16_);
    if (from_probs_) return;
    load_rows(do_a_.data(), do_th_.data(), do_tl_.data(), half_rows(p_->dout, p_->do_stride, b, h, i0),
              p_->do_stride[2], Ev_, Evp32_, Evp16_);
  }

  void scores(float* st) { band_products(st, q_a_.data(), Ep32_, k_t_.data()); }

  void grad_probs(float* dst) { band_products(dst, do_a_.data(), Evp32_, v_t_.data()); }

  // Row r of the query block's Z (its P when there is no dropout) and dS, final, n16 values each.
  void finish_row(int64_t r, const float* z, const float* ds) {
    const int64_t at = (r / 2) * ld_panel();
    if (!from_probs_) amx::split_vnni_row_from_f32(z_hi_.data() + at, z_lo_.data() + at, r, z, n_, n16_);
    amx::split_vnni_row_from_f32(ds_hi_.data() + at, ds_lo_.data() + at, r, ds, n_, n16_);
    amx::split_rows_from_f32(d_hi_.data() + r * n32_, n32_, d_lo_.data() + r * n32_, n32_, ds, n16_, 1, n_, n32_);
  }

  // dv^T (Evp16 rows, ld_keys() apart) += dO^T Z, Z's rows given to finish_row
  void add_dv(float* dv, const float*) { split_key_products(dv, Evp16_, do_th_.data(), do_tl_.data(), z_hi_, z_lo_); }

  // dq += dS K (dS split by finish_row), each block of rows over the keys it sees.
  void add_dq(float* dq, const float*) {
    zero_rows(d_hi_.data(), n32_, m_, m16_);
    zero_rows(d_lo_.data(), n32_, m_, m16_);
    this->for_row_blocks(32, [&](int64_t r0, int64_t rows, int64_t begin, int64_t end) {
      const int64_t at = r0 * n32_ + begin;
      const uint16_t* kh = k_rh_.data() + begin * Ep16_;
      const uint16_t* kl = k_rl_.data() + begin * Ep16_;
      float* c = dq + r0 * Ep16_;
      Engine::gemm(rows, Ep16_, end - begin, d_hi_.data() + at, n32_, kh, 2 * Ep16_, c, Ep16_, true);
      Engine::gemm(rows, Ep16_, end - begin, d_lo_.data() + at, n32_, kh, 2 * Ep16_, c, Ep16_, true);
      Engine::gemm(rows, Ep16_, end - begin, d_hi_.data() + at, n32_, kl, 2 * Ep16_, c, Ep16_, true);
    });
  }

  // dk^T (Ep16 rows, ld_keys() apart) += Q^T dS
  void add_dk(float* dk, const float*) { split_key_products(dk, Ep16_, q_th_.data(), q_tl_.data(), ds_hi_, ds_lo_); }

 private:
  // The block's rows of X (Q or dO, `width` columns): a (m16 x 4 w32) = [Xh | Xh | Xl | Xl] and
  // X^T split, th and tl (w16 x m32, zero past the block's m rows): VNNI panels of Xh's and Xl's
  // rows (pairs of rows as 32-bit words), whose 32-bit transposes they are.
  void load_rows(uint16_t* a, uint16_t* th, uint16_t* tl, const uint16_t* x, int64_t ldx, int64_t width,
                 int64_t w32, int64_t w16) {
    split_a_rows(a, x, ldx, m_, m16_, width, w32);
    amx::pack_vnni_from_rows(rh_.data(), a, 4 * w32, m_, width, m32_, w16);
    amx::pack_vnni_from_rows(rl_.data(), a + 2 * w32, 4 * w32, m_, width, m32_, w16);
    transpose_row_panel(th, rh_.data(), w16);
    transpose_row_panel(tl, rl_.data(), w16);
  }

  // c (m16 x n16, row stride ld16) = a bv over 4 w32 columns (two products over [Xh | Xh] and
  // [Xl | Xl] against a [Yh; Yl] panel), each block of rows over its band's columns only.
  void band_products(float* c, const uint16_t* a, int64_t w32, const uint16_t* bv) {
    const int64_t K = 2 * w32, lda = 4 * w32;
    this->for_row_blocks(16, [&](int64_t r0, int64_t rows, int64_t begin, int64_t end) {
      const uint16_t* ar = a + r0 * lda;
      float* cr = c + r0 * ld16_ + begin;
      Engine::gemm(rows, end - begin, K, ar, lda, bv + 2 * begin, 2 * kv_block_, cr, ld16_, false);
      Engine::gemm(rows, end - begin, K, ar + K, lda, bv + 2 * begin, 2 * kv_block_, cr, ld16_, true);
    });
  }

  // c += x^T y with x^T and y split: xh yh + xl yh + xh yl (key_products).
  void split_key_products(float* c, int64_t M, const uint16_t* xh, const uint16_t* xl, Buffer<uint16_t>& yh,
                          Buffer<uint16_t>& yl) {
    zero_panel_padding(yh.data());
    zero_panel_padding(yl.data());
    key_products(c, M, {{xh, yh.data()}, {xl, yh.data()}, {xh, yl.data()}});
  }

  Buffer<uint16_t> rows_, k_t_, v_t_, k_rh_, k_rl_, q_a_, do_a_, rh_, rl_, q_th_, q_tl_, do_th_, do_tl_, z_hi_, z_lo_,
      ds_hi_, ds_lo_, d_hi_, d_lo_;
};
#undef ATTN_EXT_TILE_BACKWARD_BASE

// Calls of up to kDotRows (kernels.h) query rows per block take Bf16DotProducts.

// The products take whole tiles of 16 query rows. From kDotRows + 1 rows on they
// pay off even when a tile is partly empty: measured on the AMD EPYC Zen 4 (the
// dot engine, 2 threads, bfloat16, 4 x 8 heads x 1024 keys), 9 to 15 rows took
// 2.5-2.8 ms forward on avx512's kernels (every key and value row converted to
// float32) against 0.6 ms for 16 rows on the products. The packing reads rows
// with contiguous columns.
// The tile products' packing reads rows with contiguous columns (Q, K, V; and dO).
bool rows_contiguous(const AttnParams& p) {
  return p.E > 0 && p.q_stride[3] == 1 && p.k_stride[3] == 1 && (p.v == nullptr || p.v_stride[3] == 1);
}
bool rows_contiguous(const AttnBwdParams& p) {
  return rows_contiguous(static_cast<const AttnParams&>(p)) && (p.dout == nullptr || p.do_stride[3] == 1);
}

bool products_suit(const AttnParams& p) { return p.dtype == DType::BFloat16 && p.L > kDotRows && rows_contiguous(p); }

bool products_suit(const AttnBwdParams& p) {
  return p.dtype == DType::BFloat16 && p.L > kDotRows && p.S > 0 && rows_contiguous(p);
}

// Decoding steps (up to kDotRows rows) read keys and values in place; the
// explicit-probabilities op keeps avx512's path. Measured on the Xeon (1 x 8
// heads x 4000 keys): 8 rows in place 1.7 ms against 5.2 on avx512's kernels
// (which convert every key and value row to float32 and pack it for a few
// rows; more rows take the tiles, products_suit).
bool dots_suit(const AttnParams& p) {
  return p.dtype == DType::BFloat16 && p.L <= kDotRows && p.E > 0 && p.v != nullptr && p.probs == nullptr &&
         p.q_stride[3] == 1 && p.k_stride[3] == 1 && p.v_stride[3] == 1;
}

// float16 forwards on the tiles (HalfSplitForwardProducts) from a tile of query rows, two of
// keys and 8192 (query, key) pairs per head on, with contiguous rows (rows_contiguous); the
// rest keeps avx512's kernels. Below that, splitting and packing each key
// panel and padding to whole tiles cost more than the products save. Measured on the Xeon
// (float16 forward, 8 heads, E = 64, 2 threads, ms, tiles / avx512's kernels): L = S = 1024
// (B = 4) 1.4-1.7x faster (224-234 / 141-156 GFLOP/s); L = S = 128 1.21 / 1.34-1.44;
// L = 16, S = 2048 2.1-2.3 / 2.8-2.9;
// L = 256, S = 32 4.9-5.5 / 4.9-5.0; L = S = 64 1.84-1.89 / 1.75-1.91; L = 256, S = 16
// 4.9-5.0 / 3.8-3.9; L = S = 16 1.78 / 1.52-1.63; L = S = 9 1.40-1.44 / 0.87-0.91.
bool half_products_suit(const AttnParams& p) {
  return p.dtype == DType::Float16 && p.L >= 16 && p.S >= 32 && p.L * p.S >= 8192 && rows_contiguous(p);
}

// The backward packs each key block (K^T, K's rows, V^T, hi and lo) for the query rows that see it:
// it asks for 64 of them and 64 keys. Measured on the Xeon (float16 forward + backward, 8 heads,
// E = 64, 2 threads, ms, tiles / avx512's kernels, two runs): L = S = 96 (B = 16) 11.4-12.2 /
// 13.6-13.7; L = 64, S = 128 9.9-10.3 / 11.7-11.9; L = 128, S = 64 11.7 / 12.6-13.3; L = 16,
// S = 600 27-30 / 26; L = 256, S = 32 17-20 / 18; at 4 x 8 x 1024 x 64 1.8x faster.
bool half_products_suit(const AttnBwdParams& p) {
  return half_products_suit(static_cast<const AttnParams&>(p)) && p.L >= 64 && p.S >= 64 && rows_contiguous(p);
}

// The tiles always pay; the dot engine where bf16_dot_products_pay says (kernels.h).
template <class Engine>
bool engine_pays(bool backward, int64_t rows) {
  return std::is_same_v<Engine, TileEngine> || bf16_dot_products_pay(backward, rows);
}

template <class Engine>
void bf16_forward(const AttnParams& params) {
  if (products_suit(params) && engine_pays<Engine>(false, params.L))
    return forward_driver<Bf16, Bf16ForwardProducts<Engine>>(params);
  if (dots_suit(params)) return forward_driver<Bf16, Bf16DotProducts>(params);
  AVX512::attention_forward(params);
}

template <class Engine>
void bf16_backward(const AttnBwdParams& params) {
  if (products_suit(params) && engine_pays<Engine>(true, params.L))
    return backward_driver<Bf16, Bf16BackwardProducts<Engine>>(params);
  AVX512::attention_backward(params);
}

}  // namespace

void attention_forward(const AttnParams& params) {
  if (half_products_suit(params)) return forward_driver<c10::Half, HalfSplitForwardProducts<TileEngine>>(params);
  bf16_forward<TileEngine>(params);
}
void attention_backward(const AttnBwdParams& params) {
  if (half_products_suit(params)) return backward_driver<c10::Half, HalfSplitBackwardProducts<TileEngine>>(params);
  bf16_backward<TileEngine>(params);
}

}  // namespace attn_ext::cpu::AMX

namespace attn_ext::cpu::AVX512BF16 {
void attention_forward(const AttnParams& params) { AMX::bf16_forward<AMX::DotEngine>(params); }
void attention_backward(const AttnBwdParams& params) { AMX::bf16_backward<AMX::DotEngine>(params); }
}  // namespace attn_ext::cpu::AVX512BF16

// avx512bf16 ranks below amx: where both run (Sapphire Rapids), the tiles are the default.
ATTN_EXT_REGISTER_CPU_KERNELS("avx512bf16", 3, AVX512BF16)
ATTN_EXT_REGISTER_CPU_KERNELS("amx", 4, AMX)
