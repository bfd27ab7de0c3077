// Everything the kernels depend on, included by each kernels_<isa>.cpp *before* it switches the
// compiler to its instruction set (see ../common/cpu_isa_prelude.h for why): inline functions from
// these headers are then compiled for the baseline ISA, so whichever copy the linker keeps runs on any CPU.
#pragma once

#include "../common/cpu_isa_prelude.h"

#include <ATen/Dispatch.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include <limits>
#include <vector>
