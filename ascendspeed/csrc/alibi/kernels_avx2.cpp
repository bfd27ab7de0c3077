// In-place ALiBi kernels for AVX2 + FMA CPUs (torch's "AVX2" level); see ../common/cpu_isa_avx2_begin.h.
#include "alibi_bias_kernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include "../common/cpu_isa_prelude.h"
#include "../common/cpu_isa_avx2_begin.h"
#include "alibi_bias_kernels_impl.h"
#include "../common/cpu_isa_end.h"

namespace ascendspeed::alibi {
const CpuKernels* cpu_kernels_avx2() {
  static const CpuKernels kernels{&AVX2::add_bias, "AVX2"};
  return &kernels;
}
} // namespace ascendspeed::alibi

#else
namespace ascendspeed::alibi {
const CpuKernels* cpu_kernels_avx2() {
  return nullptr;
}
} // namespace ascendspeed::alibi
#endif
