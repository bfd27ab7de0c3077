// Compiles the rest of a kernels_default.cpp for the baseline ISA, with at::vec's portable Vectorized
// (torch's "DEFAULT" level). No include guard: one use per translation unit.
#include "cpu_isa_prelude.h"

#define CPU_CAPABILITY DEFAULT
