// ALiBi flash attention CPU kernels for AVX2 + FMA CPUs (torch's "AVX2" level), built with GCC's
// target pragma so the extension keeps one set of compile flags and still runs on CPUs without AVX2.
#include "alibi_attention_kernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include "alibi_attention_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
// GCC does not define the ISA macros for a target pragma in C++, and sleef.h (the vector math
// behind Vectorized::exp) declares its wide entry points only under them.
#ifndef __AVX__
#define __AVX__ 1
#define ASCENDSPEED_DEFINED__AVX__
#endif
#include <sleef.h>
#ifdef ASCENDSPEED_DEFINED__AVX__
#undef __AVX__
#undef ASCENDSPEED_DEFINED__AVX__
#endif

#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "alibi_attention_kernels_impl.h"
#pragma GCC pop_options

namespace ascendspeed::alibi_attention {
const CpuKernels* cpu_kernels_avx2() {
  static const CpuKernels kernels{&AVX2::forward, &AVX2::backward, "AVX2"};
  return &kernels;
}
} // namespace ascendspeed::alibi_attention

#else
namespace ascendspeed::alibi_attention {
const CpuKernels* cpu_kernels_avx2() {
  return nullptr;
}
} // namespace ascendspeed::alibi_attention
#endif
