// The contract between the RMSNorm operator (rms_norm.cpp) and its CPU kernels.
//
// The kernels are compiled once per instruction set (kernels_default.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp); the operator picks the widest one that torch itself uses on this CPU.
//
// Every kernel sees x, y and their gradients as `rows` contiguous rows of `cols` elements, and the
// weight already in the math type (float, or double for double inputs) with Megatron's
// zero-centred +1 applied: `gamma` is the factor each column is multiplied by.
#pragma once

#include <ATen/core/Tensor.h>

namespace ascendspeed::rms_norm {

struct CpuKernels {
  // y = x * rstd * gamma, rstd[row] = 1 / sqrt(mean(x[row]^2) + eps)
  void (*forward)(
      const at::Tensor& x,
      const at::Tensor& gamma,
      double eps,
      const at::Tensor& y,
      const at::Tensor& rstd,
      int64_t rows,
      int64_t cols);
  // grad_x = rstd * (grad_y * gamma - x * rstd^2 * mean(grad_y * gamma * x)),
  // grad_gamma = sum over rows of grad_y * x * rstd: per-thread partial sums of one row each, then
  // one reduction (no temporary of the size of x).
  void (*backward)(
      const at::Tensor& grad_y,
      const at::Tensor& x,
      const at::Tensor& rstd,
      const at::Tensor& gamma,
      const at::Tensor& grad_x,
      const at::Tensor& grad_gamma,
      int64_t rows,
      int64_t cols);
  const char* isa;
};

// nullptr when this build has no kernels for that instruction set (another compiler or CPU family).
const CpuKernels* cpu_kernels_default();
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();

} // namespace ascendspeed::rms_norm
