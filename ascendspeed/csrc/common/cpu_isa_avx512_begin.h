// Switches the rest of a kernels_avx512.cpp to AVX-512 F/BW/VL/DQ (torch's "AVX512" level) until
// cpu_isa_end.h, with GCC's target pragma, so the extension keeps one set of compile flags and still
// loads on CPUs without AVX-512. Include cpu_isa_prelude.h first. No include guard: one use per
// translation unit.
//
// With ASCENDSPEED_WITH_AVX512_BF16 defined first (a kernels_avx512_bf16.cpp), the region also has the
// AVX512_BF16 conversion instructions (Cooper Lake, Sapphire Rapids, Zen 4 and later; chosen at run time
// only where the CPU has them, see cpu_isa.h) and is namespaced AVX512_BF16 instead of AVX512.
#pragma GCC push_options
#if defined(ASCENDSPEED_WITH_AVX512_BF16)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
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

#if defined(ASCENDSPEED_WITH_AVX512_BF16)
#define CPU_CAPABILITY AVX512_BF16
#define ASCENDSPEED_NATIVE_BF16 1
#else
#define CPU_CAPABILITY AVX512
#endif
#define CPU_CAPABILITY_AVX512
