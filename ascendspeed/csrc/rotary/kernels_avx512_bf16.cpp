// Rotary-embedding CPU kernels for AVX-512 CPUs with the AVX512_BF16 conversion instructions: the AVX-512 kernels,
// with bf16 outputs rounded by one instruction (see ../common/cpu_isa_avx512_begin.h, ../common/vec_block.h).
#define ASCENDSPEED_WITH_AVX512_BF16
#include "rotary_kernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include "../common/cpu_isa_prelude.h"
#include "../common/cpu_isa_avx512_begin.h"
#include "rotary_kernels_impl.h"
#include "../common/cpu_isa_end.h"

namespace ascendspeed::rotary {
const CpuKernels* cpu_kernels_avx512_bf16() {
  static const CpuKernels kernels{&AVX512_BF16::apply, "AVX512_BF16"};
  return &kernels;
}
} // namespace ascendspeed::rotary

#else
namespace ascendspeed::rotary {
const CpuKernels* cpu_kernels_avx512_bf16() {
  return nullptr;
}
} // namespace ascendspeed::rotary
#endif
