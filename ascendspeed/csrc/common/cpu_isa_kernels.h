// How an operator compiles its CPU kernels once per instruction set.
//
// The kernels are written once, in <op>_kernels_impl.h, against at::vec::Vectorized, and each of the
// operator's three translation units compiles them for one of torch's CPU capability levels:
//
//   // <op>/kernels_avx2.cpp
//   #include "<op>_kernels.h"
//   #include "../common/cpu_isa_kernels.h"
//   #if ASCENDSPEED_CPU_ISA_REGIONS
//   #include "../common/cpu_isa_avx2_begin.h"
//   #include "<op>_kernels_impl.h"
//   #include "../common/cpu_isa_end.h"
//   #endif
//   ASCENDSPEED_DEFINE_CPU_KERNELS(<op>, avx2, &forward, &backward)
//
// kernels_default.cpp includes cpu_isa_default_begin.h instead, unconditionally. The wide instruction
// sets are switched on by GCC target pragmas for a region of the file, not by compile flags, so the
// extension keeps one set of flags and still loads on CPUs without AVX2; only the code inside the
// region may use the wide instructions (see cpu_isa_prelude.h). The operator's .cpp then takes the
// widest table this CPU supports with cpu::widest_kernels (cpu_isa.h).
#pragma once

// Where GCC cannot switch instruction sets per region (another compiler, another CPU family) only the
// DEFAULT kernels are built; the AVX2 and AVX512 tables are nullptr.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define ASCENDSPEED_CPU_ISA_REGIONS 1
#else
#define ASCENDSPEED_CPU_ISA_REGIONS 0
#endif

// Defines ascendspeed::<op>::cpu_kernels_<isa>() (isa: default, avx2 or avx512), the operator's
// CpuKernels table for that instruction set: the members in order, with the kernels' names looked up
// in the instruction set's namespace (ascendspeed::<op>::AVX2, ...), and the level's name, "AVX2",
// last. The table is nullptr where this build has no kernels for that instruction set.
#define ASCENDSPEED_DEFINE_CPU_KERNELS(op, isa, ...)   \
  namespace ascendspeed::op {                          \
  const CpuKernels* cpu_kernels_##isa() {              \
    ASCENDSPEED_CPU_KERNELS_TABLE_##isa(__VA_ARGS__)   \
  }                                                    \
  }

#define ASCENDSPEED_CPU_KERNELS_TABLE(ISA, ...)         \
  using namespace ISA;                                 \
  static const CpuKernels kernels{__VA_ARGS__, #ISA};  \
  return &kernels;

#define ASCENDSPEED_CPU_KERNELS_TABLE_default(...) ASCENDSPEED_CPU_KERNELS_TABLE(DEFAULT, __VA_ARGS__)
#if ASCENDSPEED_CPU_ISA_REGIONS
#define ASCENDSPEED_CPU_KERNELS_TABLE_avx2(...) ASCENDSPEED_CPU_KERNELS_TABLE(AVX2, __VA_ARGS__)
#define ASCENDSPEED_CPU_KERNELS_TABLE_avx512(...) ASCENDSPEED_CPU_KERNELS_TABLE(AVX512, __VA_ARGS__)
#else
#define ASCENDSPEED_CPU_KERNELS_TABLE_avx2(...) return nullptr;
#define ASCENDSPEED_CPU_KERNELS_TABLE_avx512(...) return nullptr;
#endif
