// Rotary-embedding CPU kernels for any CPU: at::vec's portable Vectorized, baseline ISA.
// Compiled as ../common/cpu_isa_kernels.h describes.
#include "rotary_kernels.h"
#include "../common/cpu_isa_kernels.h"
#include "../common/cpu_isa_default_begin.h"
#include "rotary_kernels_impl.h"

ASCENDSPEED_DEFINE_CPU_KERNELS(rotary, default, &apply)
