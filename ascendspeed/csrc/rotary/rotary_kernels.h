// The contract between the rotary-embedding operator (rotary.cpp) and its CPU kernels.
//
// The kernels are compiled once per instruction set (kernels_default.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp); the operator picks the widest one that torch itself uses on this CPU.
#pragma once

#include <ATen/core/Tensor.h>

namespace ascendspeed::rotary {

struct CpuKernels {
  // out = t with its first d_rot = freqs.size(-1) features rotated, the rest copied.
  // t: [s, b, h, d], its last dimension contiguous (other strides arbitrary); out: contiguous
  // [s, b, h, d]; freqs: contiguous [s, d_rot] in the math type of t (float, or double for double).
  // Feature pairs (a, b) are (i, i + d_rot / 2) or, interleaved, (2i, 2i + 1); with angles f:
  //   forward:   out_a = t_a cos f_a - t_b sin f_a,   out_b = t_b cos f_b + t_a sin f_b
  //   transpose: out_a = t_a cos f_a + t_b sin f_b,   out_b = t_b cos f_b - t_a sin f_a
  // The transpose is the backward (the rotation by -theta when f_a = f_b, as Megatron's freqs are).
  void (*apply)(const at::Tensor& t, const at::Tensor& freqs, bool interleaved, bool transpose, const at::Tensor& out);
  const char* isa;
};

// nullptr when this build has no kernels for that instruction set (another compiler or CPU family).
const CpuKernels* cpu_kernels_default();
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();

} // namespace ascendspeed::rotary
