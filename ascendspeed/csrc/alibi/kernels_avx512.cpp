// In-place ALiBi kernels for AVX-512 F/BW/VL/DQ CPUs (torch's "AVX512" level); see ../common/cpu_isa_avx512_begin.h.
#include "alibi_bias_kernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include "../common/cpu_isa_prelude.h"
#include "../common/cpu_isa_avx512_begin.h"
#include "alibi_bias_kernels_impl.h"
#include "../common/cpu_isa_end.h"

namespace ascendspeed::alibi {
const CpuKernels* cpu_kernels_avx512() {
  static const CpuKernels kernels{&AVX512::add_bias, "AVX512"};
  return &kernels;
}
} // namespace ascendspeed::alibi

#else
namespace ascendspeed::alibi {
const CpuKernels* cpu_kernels_avx512() {
  return nullptr;
}
} // namespace ascendspeed::alibi
#endif
