// SwiGLU CPU kernels for AVX2 + FMA CPUs (torch's "AVX2" level).
// Compiled as ../common/cpu_isa_kernels.h describes.
#include "swiglu_kernels.h"
#include "../common/cpu_isa_kernels.h"

#if ASCENDSPEED_CPU_ISA_REGIONS
#include "../common/cpu_isa_avx2_begin.h"
#include "swiglu_kernels_impl.h"
#include "../common/cpu_isa_end.h"
#endif

ASCENDSPEED_DEFINE_CPU_KERNELS(
    swiglu, avx2, &forward, &backward, &weighted_forward, &weighted_backward)
