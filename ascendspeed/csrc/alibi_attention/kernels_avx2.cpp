// ALiBi flash attention CPU kernels for AVX2 + FMA CPUs (torch's "AVX2" level); see
// ../common/cpu_isa_avx2_begin.h.
#include "alibi_attention_kernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include "alibi_attention_prelude.h"
#include "../common/cpu_isa_avx2_begin.h"
#include "alibi_attention_kernels_impl.h"
#include "../common/cpu_isa_end.h"

namespace ascendspeed::alibi_attention {
const CpuKernels* cpu_kernels_avx2() {
  static const CpuKernels kernels{&AVX2::forward, &AVX2::backward, "AVX2"};
  return &kernels;
}
} // namespace ascendspeed::alibi_attention

#else
namespace ascendspeed::alibi_attention {
const CpuKernels* cpu_kernels_avx2() {
  return nullptr;
}
} // namespace ascendspeed::alibi_attention
#endif
