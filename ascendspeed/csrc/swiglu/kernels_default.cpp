// SwiGLU CPU kernels for any CPU: at::vec's portable Vectorized, compiled for the baseline ISA.
#include "swiglu_kernels.h"
#include "swiglu_kernels_prelude.h"

#define CPU_CAPABILITY DEFAULT
#include "swiglu_kernels_impl.h"

namespace ascendspeed::swiglu {

const CpuKernels* cpu_kernels_default() {
  static const CpuKernels kernels{&DEFAULT::forward, &DEFAULT::backward, "DEFAULT"};
  return &kernels;
}

} // namespace ascendspeed::swiglu
