// The contract between the SwiGLU operator (swiglu.cpp) and its CPU kernels.
//
// The kernels are compiled once per instruction set (kernels_default.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp); the operator picks the widest one that torch itself uses on this CPU.
//
// Every kernel sees x as `rows` rows of [a | b], each half `len` contiguous elements: any split
// dimension of a contiguous tensor reduces to this, with rows = prod(sizes before dim) and
// len = size(dim) / 2 * prod(sizes after dim). y and the gradient of y are `rows` rows of `len`.
#pragma once

#include <ATen/core/Tensor.h>

namespace ascendspeed::swiglu {

struct CpuKernels {
  // y = silu(a) * b
  void (*forward)(const at::Tensor& x, const at::Tensor& y, int64_t rows, int64_t len);
  // grad_x = [grad_y * b * s * (1 + a * (1 - s)) | grad_y * silu(a)], s = sigmoid(a)
  void (*backward)(
      const at::Tensor& grad_y,
      const at::Tensor& x,
      const at::Tensor& grad_x,
      int64_t rows,
      int64_t len);
  // y = silu(a) * b * w[row], w one opmath value per row (float; double for double x)
  void (*weighted_forward)(
      const at::Tensor& x, const at::Tensor& w, const at::Tensor& y, int64_t rows, int64_t len);
  // grad_x as backward with grad_y * w[row]; grad_w[row] = sum over the row of grad_y * silu(a) * b,
  // accumulated in opmath in an order fixed by len and the vector width (not by the thread count)
  void (*weighted_backward)(
      const at::Tensor& grad_y,
      const at::Tensor& x,
      const at::Tensor& w,
      const at::Tensor& grad_x,
      const at::Tensor& grad_w,
      int64_t rows,
      int64_t len);
  const char* isa;
};

// nullptr when this build has no kernels for that instruction set (another compiler or CPU family).
const CpuKernels* cpu_kernels_default();
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();

} // namespace ascendspeed::swiglu
