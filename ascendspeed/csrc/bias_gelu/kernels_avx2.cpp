// Bias-GeLU CPU kernels for AVX2 + FMA CPUs (torch's "AVX2" level).
// Compiled as ../common/cpu_isa_kernels.h describes.
#include "bias_gelu_kernels.h"
#include "../common/cpu_isa_kernels.h"

#if ASCENDSPEED_CPU_ISA_REGIONS
#include "../common/cpu_isa_avx2_begin.h"
#include "bias_gelu_kernels_impl.h"
#include "../common/cpu_isa_end.h"
#endif

ASCENDSPEED_DEFINE_CPU_KERNELS(bias_gelu, avx2, &forward, &backward)
