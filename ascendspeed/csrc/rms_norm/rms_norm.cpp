// RMSNorm as torch operators:
//   ascendspeed::rms_norm(x, weight, eps, zero_centered_gamma) -> (y, rstd)
//     y = x * rstd * gamma over the last dimension, rstd = 1 / sqrt(mean(x^2, -1) + eps) per row,
//     gamma = weight, or weight + 1 with zero_centered_gamma (Megatron's layernorm_zero_centered_gamma);
//   ascendspeed::rms_norm_backward(grad_y, x, rstd, weight, zero_centered_gamma) -> (grad_x, grad_weight),
//     which needs only x and the per-row rstd: autograd saves nothing of the size of y.
//
// This file owns the schemas, the argument checks (one function per operator, used by the CPU and the
// Meta kernels) and the choice of CPU kernel; the kernels are in rms_norm_kernels_impl.h. Autograd and
// the CUDA / NPU kernels are registered from Python by ascendspeed/ops/rms_norm.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../common/cpu_isa.h"
#include "rms_norm_kernels.h"

namespace ascendspeed::rms_norm {
namespace {

bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble;
}

void check_x_and_weight(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(
      x.dim() > 0 && x.size(-1) > 0,
      op,
      ": x must have a non-empty last dimension (the one normalized), got shape ",
      x.sizes());
  TORCH_CHECK_TYPE(
      is_supported_float(x.scalar_type()),
      op,
      ": x must be float32, bfloat16, float16 or float64, got ",
      x.scalar_type());
  TORCH_CHECK_VALUE(
      weight.dim() == 1 && weight.size(0) == x.size(-1),
      op,
      ": weight must be 1-D with x.size(-1) = ",
      x.size(-1),
      " elements, got shape ",
      weight.sizes());
  TORCH_CHECK_TYPE(
      is_supported_float(weight.scalar_type()),
      op,
      ": weight must be float32, bfloat16, float16 or float64, got ",
      weight.scalar_type());
  TORCH_CHECK(
      weight.device() == x.device(),
      op,
      ": weight must be on the device of x (",
      x.device(),
      "), got ",
      weight.device(),
      "; move it with weight.to(x.device)");
}

// The math type of x's dtype: rstd and the kernels' arithmetic use it.
at::ScalarType opmath_type(const at::Tensor& x) {
  return at::toOpMathType(x.scalar_type());
}

std::vector<int64_t> row_shape(const at::Tensor& x) {
  return x.sizes().slice(0, x.dim() - 1).vec();
}

// Every rejection of rms_norm's arguments; called by its CPU and Meta kernels (and so, through meta
// tensors, by the Python kernels of other devices).
void check_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_x_and_weight("rms_norm", x, weight);
  TORCH_CHECK_VALUE(
      std::isfinite(eps) && eps >= 0,
      "rms_norm: eps must be a finite number >= 0 (Megatron's default is 1e-5), got ",
      eps);
}

// Every rejection of rms_norm_backward's arguments; called by its CPU and Meta kernels.
void check_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& weight) {
  check_x_and_weight("rms_norm_backward", x, weight);
  TORCH_CHECK_VALUE(
      grad_y.sizes() == x.sizes(),
      "rms_norm_backward: grad_y must have the shape of x ",
      x.sizes(),
      ", got ",
      grad_y.sizes());
  TORCH_CHECK_TYPE(
      grad_y.scalar_type() == x.scalar_type(),
      "rms_norm_backward: grad_y must have the dtype of x (",
      x.scalar_type(),
      "), got ",
      grad_y.scalar_type());
  TORCH_CHECK_VALUE(
      rstd.sizes() == at::IntArrayRef(row_shape(x)),
      "rms_norm_backward: rstd must have the shape of x without its last dimension ",
      at::IntArrayRef(row_shape(x)),
      " (the second output of rms_norm), got ",
      rstd.sizes());
  TORCH_CHECK_TYPE(
      rstd.scalar_type() == opmath_type(x),
      "rms_norm_backward: rstd must be ",
      opmath_type(x),
      " for x of dtype ",
      x.scalar_type(),
      " (the second output of rms_norm), got ",
      rstd.scalar_type());
  TORCH_CHECK(
      grad_y.device() == x.device() && rstd.device() == x.device(),
      "rms_norm_backward: grad_y and rstd must be on the device of x (",
      x.device(),
      "), got ",
      grad_y.device(),
      " and ",
      rstd.device());
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels& chosen =
      cpu::widest_kernels(cpu_kernels_avx512(), cpu_kernels_avx2(), cpu_kernels_default());
  return chosen;
}

// The factor each column is multiplied by, in the math type, contiguous.
at::Tensor gamma_of(const at::Tensor& weight, const at::Tensor& x, bool zero_centered_gamma) {
  auto gamma = weight.to(opmath_type(x)).contiguous();
  return zero_centered_gamma ? gamma.add(1) : gamma;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(
    const at::Tensor& input, const at::Tensor& weight, double eps, bool zero_centered_gamma) {
  check_forward(input, weight, eps);
  const at::Tensor x = input.contiguous();
  const int64_t cols = x.size(-1);
  const int64_t rows = x.numel() / cols;
  auto y = cpu::empty_output(x.sizes(), x.options());
  auto rstd = at::empty(row_shape(x), x.options().dtype(opmath_type(x)));
  if (rows > 0) {
    cpu_kernels().forward(x, gamma_of(weight, x, zero_centered_gamma), eps, y, rstd, rows, cols);
  }
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(
    const at::Tensor& grad_y,
    const at::Tensor& input,
    const at::Tensor& rstd,
    const at::Tensor& weight,
    bool zero_centered_gamma) {
  check_backward(grad_y, input, rstd, weight);
  const at::Tensor x = input.contiguous();
  const int64_t cols = x.size(-1);
  const int64_t rows = x.numel() / cols;
  auto grad_x = cpu::empty_output(x.sizes(), x.options());
  auto grad_gamma = at::zeros({cols}, x.options().dtype(opmath_type(x)));
  if (rows > 0) {
    cpu_kernels().backward(
        grad_y.contiguous(),
        x,
        rstd.contiguous(),
        gamma_of(weight, x, zero_centered_gamma),
        grad_x,
        grad_gamma,
        rows,
        cols);
  }
  return {grad_x, grad_gamma.to(weight.scalar_type())};
}

// Shapes, dtypes and strides only: what FakeTensor and torch.compile see.
std::tuple<at::Tensor, at::Tensor> rms_norm_meta(
    const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered_gamma) {
  check_forward(x, weight, eps);
  return {
      at::empty(x.sizes(), x.options()),
      at::empty(row_shape(x), x.options().dtype(opmath_type(x)))};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(
    const at::Tensor& grad_y,
    const at::Tensor& x,
    const at::Tensor& rstd,
    const at::Tensor& weight,
    bool zero_centered_gamma) {
  check_backward(grad_y, x, rstd, weight);
  return {at::empty(x.sizes(), x.options()), at::empty(weight.sizes(), weight.options())};
}

std::string cpu_kernel() {
  return cpu::describe_kernels(cpu_kernels().isa);
}

} // namespace
} // namespace ascendspeed::rms_norm

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.rms_norm");
  m.def(
      "rms_norm(Tensor x, Tensor weight, float eps=1e-05, bool zero_centered_gamma=False) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "rms_norm_backward(Tensor grad_y, Tensor x, Tensor rstd, Tensor weight, bool zero_centered_gamma=False) "
      "-> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("_rms_norm_cpu_kernel() -> str", &ascendspeed::rms_norm::cpu_kernel);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("rms_norm", &ascendspeed::rms_norm::rms_norm_cpu);
  m.impl("rms_norm_backward", &ascendspeed::rms_norm::rms_norm_backward_cpu);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("rms_norm", &ascendspeed::rms_norm::rms_norm_meta);
  m.impl("rms_norm_backward", &ascendspeed::rms_norm::rms_norm_backward_meta);
}
