// Rotary-embedding CPU kernels for any CPU: at::vec's portable Vectorized, compiled for the baseline ISA.
#include "rotary_kernels.h"
#include "../common/cpu_isa_prelude.h"

#define CPU_CAPABILITY DEFAULT
#include "rotary_kernels_impl.h"

namespace ascendspeed::rotary {
const CpuKernels* cpu_kernels_default() {
  static const CpuKernels kernels{&DEFAULT::apply, "DEFAULT"};
  return &kernels;
}
} // namespace ascendspeed::rotary
