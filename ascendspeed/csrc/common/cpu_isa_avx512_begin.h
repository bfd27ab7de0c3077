// Switches the rest of a kernels_avx512.cpp to AVX-512 F/BW/VL/DQ (torch's "AVX512" level) until
// cpu_isa_end.h, with GCC's target pragma, so the extension keeps one set of compile flags and still
// loads on CPUs without AVX-512. Only where ASCENDSPEED_CPU_ISA_REGIONS (cpu_isa_kernels.h). No include
// guard: one use per translation unit.
#include "cpu_isa_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
// GCC does not define the ISA macros for a target pragma in C++, and sleef.h (the vector math behind
// Vectorized::exp/cos/sin) declares its wide entry points only under them.
#ifndef __AVX__
#define __AVX__ 1
#define ASCENDSPEED_DEFINED__AVX__
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#define ASCENDSPEED_DEFINED__AVX512F__
#endif
#include <sleef.h>
#ifdef ASCENDSPEED_DEFINED__AVX512F__
#undef __AVX512F__
#undef ASCENDSPEED_DEFINED__AVX512F__
#endif
#ifdef ASCENDSPEED_DEFINED__AVX__
#undef __AVX__
#undef ASCENDSPEED_DEFINED__AVX__
#endif

#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
