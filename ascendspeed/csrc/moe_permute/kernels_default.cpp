// MoE permutation row kernels for any CPU: at::vec's portable Vectorized, baseline ISA.
// Compiled as ../common/cpu_isa_kernels.h describes; products and sums stay unfused (see the impl).
#include "../common/no_fp_contraction.h"
#include "moe_permute_kernels.h"
#include "../common/cpu_isa_kernels.h"
#include "../common/cpu_isa_default_begin.h"
#include "moe_permute_kernels_impl.h"

ASCENDSPEED_DEFINE_CPU_KERNELS(moe_permute, default, &gather_rows, &scatter_add_rows)
