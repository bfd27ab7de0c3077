// MoE permutation row kernels for AVX-512 F/BW/VL/DQ CPUs (torch's "AVX512" level).
// Compiled as ../common/cpu_isa_kernels.h describes; products and sums stay unfused (see the impl).
#include "../common/no_fp_contraction.h"
#include "moe_permute_kernels.h"
#include "../common/cpu_isa_kernels.h"

#if ASCENDSPEED_CPU_ISA_REGIONS
#include "../common/cpu_isa_avx512_begin.h"
#include "moe_permute_kernels_impl.h"
#include "../common/cpu_isa_end.h"
#endif

ASCENDSPEED_DEFINE_CPU_KERNELS(moe_permute, avx512, &gather_rows, &scatter_add_rows)
