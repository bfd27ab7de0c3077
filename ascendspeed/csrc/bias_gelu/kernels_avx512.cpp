// Bias-GeLU CPU kernels for AVX-512 F/BW/VL/DQ CPUs (torch's "AVX512" level).
// Compiled as ../common/cpu_isa_kernels.h describes.
#include "bias_gelu_kernels.h"
#include "../common/cpu_isa_kernels.h"

#if ASCENDSPEED_CPU_ISA_REGIONS
#include "../common/cpu_isa_avx512_begin.h"
#include "bias_gelu_kernels_impl.h"
#include "../common/cpu_isa_end.h"
#endif

ASCENDSPEED_DEFINE_CPU_KERNELS(bias_gelu, avx512, &forward, &backward)
