// attn_ext: run-time choice of the CPU kernels' instruction set.
#include <cstring>

#include <ATen/Version.h>  // at::get_cpu_capability

#include "kernels.h"

namespace attn_ext::cpu {

namespace {
bool use_avx2() {
#if defined(ATTN_EXT_HAVE_AVX2)
  // PyTorch's own answer: the CPU's capability, lowered by ATEN_CPU_CAPABILITY.
  static const bool avx2 = [] {
    const std::string cap = at::get_cpu_capability();
    return cap == "AVX2" || cap == "AVX512";
  }();
  return avx2;
#else
  return false;
#endif
}
}  // namespace

const char* active_isa() { return use_avx2() ? "AVX2" : "DEFAULT"; }

const char* compiled_isas() {
#if defined(ATTN_EXT_HAVE_AVX2)
  return "DEFAULT AVX2";
#else
  return "DEFAULT";
#endif
}

void attention_forward(const AttnParams& params) {
#if defined(ATTN_EXT_HAVE_AVX2)
  if (use_avx2()) return AVX2::attention_forward(params);
#endif
  DEFAULT::attention_forward(params);
}

void attention_backward(const AttnBwdParams& params) {
#if defined(ATTN_EXT_HAVE_AVX2)
  if (use_avx2()) return AVX2::attention_backward(params);
#endif
  DEFAULT::attention_backward(params);
}

}  // namespace attn_ext::cpu
