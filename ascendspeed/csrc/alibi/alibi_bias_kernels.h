// The contract between the in-place ALiBi operator (alibi_bias.cpp) and its CPU kernels, compiled once
// per instruction set (kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp); the operator picks
// the widest one torch itself uses on this CPU.
#pragma once

#include <ATen/core/Tensor.h>

namespace ascendspeed::alibi {

struct CpuKernels {
  // scores[b, h, i, j] += -slopes[h] * distance(i + q_offset, j) for [b, h, sq, sk] or [h, sq, sk]
  // scores of any strides (checked by the operator); slopes: one float per head, contiguous.
  void (*add_bias)(const at::Tensor& scores, const float* slopes, int64_t q_offset, bool symmetric);
  const char* isa;
};

// nullptr when this build has no kernels for that instruction set (another compiler or CPU family).
const CpuKernels* cpu_kernels_default();
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();

} // namespace ascendspeed::alibi
