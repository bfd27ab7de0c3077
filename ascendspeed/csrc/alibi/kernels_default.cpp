// In-place ALiBi kernels for any CPU: at::vec's portable Vectorized, compiled for the baseline ISA.
#include "alibi_bias_kernels.h"
#include "../common/cpu_isa_prelude.h"

#define CPU_CAPABILITY DEFAULT
#include "alibi_bias_kernels_impl.h"

namespace ascendspeed::alibi {
const CpuKernels* cpu_kernels_default() {
  static const CpuKernels kernels{&DEFAULT::add_bias, "DEFAULT"};
  return &kernels;
}
} // namespace ascendspeed::alibi
