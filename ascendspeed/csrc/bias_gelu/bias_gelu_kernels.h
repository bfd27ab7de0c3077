// The contract between the bias-GeLU operator (bias_gelu.cpp) and its CPU kernels.
//
// The kernels are compiled once per instruction set (kernels_default.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp); the operator picks the widest one that torch itself uses on this CPU.
//
// Every kernel sees y (and the gradient) as `rows` contiguous rows of `len` elements and the bias as one
// contiguous row of `len` elements of the same dtype, added to every row.
#pragma once

#include <ATen/core/Tensor.h>

namespace ascendspeed::bias_gelu {

struct CpuKernels {
  // out = x * sigmoid(2u), x = y + bias, u = k * x * (1 + c * x^2): GeLU's tanh approximation
  void (*forward)(const at::Tensor& y, const at::Tensor& bias, const at::Tensor& out, int64_t rows, int64_t len);
  // grad_y = grad * (s + 2 x s (1 - s) (k + 3 c k x^2)), s = sigmoid(2u)
  void (*backward)(
      const at::Tensor& grad,
      const at::Tensor& y,
      const at::Tensor& bias,
      const at::Tensor& grad_y,
      int64_t rows,
      int64_t len);
  const char* isa;
};

// nullptr when this build has no kernels for that instruction set (another compiler or CPU family).
const CpuKernels* cpu_kernels_default();
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();

} // namespace ascendspeed::bias_gelu
