// RMSNorm CPU kernels for any CPU: at::vec's portable Vectorized, baseline ISA.
// Compiled as ../common/cpu_isa_kernels.h describes.
#include "rms_norm_kernels.h"
#include "../common/cpu_isa_kernels.h"
#include "../common/cpu_isa_default_begin.h"
#include "rms_norm_kernels_impl.h"

ASCENDSPEED_DEFINE_CPU_KERNELS(rms_norm, default, &forward, &backward)
