// RMSNorm CPU kernels for any CPU: at::vec's portable Vectorized, compiled for the baseline ISA.
#include "rms_norm_kernels.h"
#include "../common/cpu_isa_prelude.h"

#define CPU_CAPABILITY DEFAULT
#include "rms_norm_kernels_impl.h"

namespace ascendspeed::rms_norm {
const CpuKernels* cpu_kernels_default() {
  static const CpuKernels kernels{&DEFAULT::forward, &DEFAULT::backward, "DEFAULT"};
  return &kernels;
}
} // namespace ascendspeed::rms_norm
