// RMSNorm CPU kernels for AVX-512 F/BW/VL/DQ CPUs (torch's "AVX512" level); see ../common/cpu_isa_avx512_begin.h.
#include "rms_norm_kernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include "../common/cpu_isa_prelude.h"
#include "../common/cpu_isa_avx512_begin.h"
#include "rms_norm_kernels_impl.h"
#include "../common/cpu_isa_end.h"

namespace ascendspeed::rms_norm {
const CpuKernels* cpu_kernels_avx512() {
  static const CpuKernels kernels{&AVX512::forward, &AVX512::backward, "AVX512"};
  return &kernels;
}
} // namespace ascendspeed::rms_norm

#else
namespace ascendspeed::rms_norm {
const CpuKernels* cpu_kernels_avx512() {
  return nullptr;
}
} // namespace ascendspeed::rms_norm
#endif
