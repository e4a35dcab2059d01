// attn_ext: the table of CPU kernel variants and the run-time choice among them.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>  // sysconf: the L2 size

#include <ATen/Version.h>  // at::get_cpu_capability
#include <c10/util/Exception.h>

#include "kernels.h"
#if defined(__x86_64__) || defined(_M_X64)
#include "amx_bf16.h"  // its availability checks only
#endif

namespace attn_ext::cpu {

namespace {

std::vector<CpuKernels>& table() {
  static std::vector<CpuKernels> kernels;  // sorted by rank, narrowest first
  return kernels;
}

// What the user asked for, read on every call so that a test can switch variants.
std::string requested_isa() {
  const char* env = std::getenv("ATTN_EXT_CPU_ISA");
  return env == nullptr ? std::string() : std::string(env);
}

// ATEN_CPU_CAPABILITY caps PyTorch's own kernels; the default choice follows it.
int aten_cap_rank() {
  const std::string cap = at::get_cpu_capability();
  if (cap == "AVX512") return 1 << 30;  // avx512, avx512bf16 and amx
  if (cap == "AVX2") return 1;
  return 0;
}

std::string names(bool supported_only) {
  std::string out;
  for (const CpuKernels& k : table())
    if (!supported_only || cpu_supports(k.isa)) out += (out.empty() ? "" : " ") + std::string(k.isa);
  return out;
}

}  // namespace

int64_t l2_cache_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // 0 or -1 where the OS does not say
    return l2 > 0 ? int64_t(l2) : int64_t(512) << 10;
  }();
  return bytes;
}

BlockSizes forward_blocks(int64_t E, int64_t Ev) {
  constexpr int64_t q = kMaxQTile;
  int64_t kv = kMaxForwardKeys;
  while (kv > kMinTileKeys && (q * kv + kv * (E + Ev) + q * (E + Ev)) * 4 > l2_cache_bytes() / 2) kv /= 2;
  return BlockSizes{q, kv};
}

BlockSizes backward_blocks(int64_t E, int64_t Ev) {
  constexpr int64_t q = kMaxQTile;
  int64_t kv = kMaxBackwardKeys;
  while (kv > kMinTileKeys && (3 * q * kv + kv * 3 * (E + Ev) + 2 * q * (E + Ev)) * 4 > l2_cache_bytes() / 2)
    kv /= 2;
  return BlockSizes{q, kv};
}

namespace {
bool cpu_is_intel() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}
}  // namespace

bool bf16_dot_products_pay(bool backward, int64_t rows) {
  static const bool intel = cpu_is_intel();
  if (!intel || requested_isa() == "avx512bf16") return true;
  return !backward && rows < kIntelDotForwardRows;
}

bool register_cpu_kernels(const CpuKernels& kernels) {
  auto& t = table();
  t.insert(std::upper_bound(t.begin(), t.end(), kernels,
                            [](const CpuKernels& a, const CpuKernels& b) { return a.rank < b.rank; }),
           kernels);
  return true;
}

bool cpu_supports(const std::string& isa) {
  if (isa == "default") return true;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return avx2;
  if (isa == "avx512") return avx512;
  if (isa == "avx512bf16") return avx512 && amx::cpu_has_avx512_bf16();
  // AMX also needs the kernel's permission for the tile state (asked once, here).
  if (isa == "amx") return avx512 && amx::cpu_has_amx_bf16() && amx::request_amx_permission();
#endif
  return false;
}

const CpuKernels& active_kernels() {
  static std::mutex mu;
  static std::string cached_request = "\x01";  // never a real value
  static const CpuKernels* cached = nullptr;
  const std::string request = requested_isa();
  std::lock_guard<std::mutex> lock(mu);
  if (cached != nullptr && request == cached_request) return *cached;

  const auto& t = table();
  TORCH_CHECK(!t.empty(), "attn_ext: no CPU kernels were registered");
  const CpuKernels* pick = nullptr;
  if (!request.empty()) {
    for (const CpuKernels& k : t)
      if (request == k.isa) pick = &k;
    TORCH_CHECK(pick != nullptr, "attn_ext: ATTN_EXT_CPU_ISA=", request,
                " names no CPU kernel variant of this build; it has: ", names(false),
                " (unset it to let attn_ext choose)");
    TORCH_CHECK(cpu_supports(request), "attn_ext: ATTN_EXT_CPU_ISA=", request,
                " but this CPU cannot run that variant; it runs: ", names(true));
  } else {
    const int cap = aten_cap_rank();
    for (const CpuKernels& k : t)
      if (k.rank <= cap && cpu_supports(k.isa)) pick = &k;
    if (pick == nullptr) pick = &t.front();
  }
  cached_request = request;
  cached = pick;
  return *pick;
}

std::string kernel_info() {
  std::ostringstream os;
  os << "cpu_isas=" << names(false) << ";cpu_isas_supported=" << names(true) << ";cpu_isa_active=";
  try {
    os << active_kernels().isa;
  } catch (const c10::Error&) {
    os << "none (ATTN_EXT_CPU_ISA=" << requested_isa() << " is not usable)";
  }
  // the tiles' bounds (forward_blocks / backward_blocks choose within them by the L2 size)
  os << ";cpu_l2_bytes=" << l2_cache_bytes() << ";cpu_tile_rows=" << kMaxQTile << ";cpu_forward_tile_keys="
     << kMinTileKeys << ".." << kMaxForwardKeys << ";cpu_backward_tile_keys=" << kMinTileKeys << ".."
     << kMaxBackwardKeys;
  // query blocks this small read key rows in place (decoding)
  os << ";cpu_direct_rows=" << kDirectRows << ";cpu_direct_rows_converted=" << kDirectRowsConverted
     << ";cpu_dot_rows=" << kDotRows;
  // where avx512bf16's blocked bfloat16 products take its dot products (bf16_dot_products_pay)
  os << ";cpu_bf16_dot_products="
     << (bf16_dot_products_pay(true, kIntelDotForwardRows) ? "all"
                                                             : "forward_rows<" + std::to_string(kIntelDotForwardRows));
  return os.str();
}

void attention_forward(const AttnParams& params) { active_kernels().forward(params); }

void attention_backward(const AttnBwdParams& params) { active_kernels().backward(params); }

}  // namespace attn_ext::cpu
