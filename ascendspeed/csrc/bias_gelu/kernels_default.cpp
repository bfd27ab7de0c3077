// Bias-GeLU CPU kernels for any CPU: at::vec's portable Vectorized, baseline ISA.
// Compiled as ../common/cpu_isa_kernels.h describes.
#include "bias_gelu_kernels.h"
#include "../common/cpu_isa_kernels.h"
#include "../common/cpu_isa_default_begin.h"
#include "bias_gelu_kernels_impl.h"

ASCENDSPEED_DEFINE_CPU_KERNELS(bias_gelu, default, &forward, &backward)
