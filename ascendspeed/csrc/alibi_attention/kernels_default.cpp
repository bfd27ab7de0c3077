// ALiBi flash attention CPU kernels for any CPU: at::vec's portable Vectorized, baseline ISA.
// Compiled as ../common/cpu_isa_kernels.h describes.
#include "alibi_attention_kernels.h"
#include "../common/cpu_isa_kernels.h"
#include "../common/cpu_isa_default_begin.h"
#include "alibi_attention_kernels_impl.h"

ASCENDSPEED_DEFINE_CPU_KERNELS(alibi_attention, default, &forward, &backward, &native_bf16_conversion)
