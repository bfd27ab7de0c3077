// SwiGLU CPU kernels for any CPU: at::vec's portable Vectorized, baseline ISA.
// Compiled as ../common/cpu_isa_kernels.h describes.
#include "swiglu_kernels.h"
#include "../common/cpu_isa_kernels.h"
#include "../common/cpu_isa_default_begin.h"
#include "swiglu_kernels_impl.h"

ASCENDSPEED_DEFINE_CPU_KERNELS(
    swiglu, default, &forward, &backward, &weighted_forward, &weighted_backward)
