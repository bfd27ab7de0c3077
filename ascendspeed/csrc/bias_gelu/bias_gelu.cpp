// megatron-core's bias-GeLU (fusions.fused_bias_gelu: GeLU's tanh approximation of y + bias, Megatron's
// default MLP activation with a bias) as torch operators for the CPU:
//   ascendspeed::bias_gelu(y, bias) = gelu_tanh(y + bias), bias broadcast along the last dimension;
//   ascendspeed::bias_gelu_backward(grad, y, bias) = grad * gelu_tanh'(y + bias).
// Computed as x * sigmoid(2u) (0.5 * (1 + tanh(u)) = sigmoid(2u)) in fp32 for bfloat16 / float16 and
// rounded once. Megatron's GeLUFunction calls the two separately (ascendspeed/accelerator/cpu_fusions.py).
//
// This file owns the schemas, the one argument check of each operator (called by the CPU and the Meta
// kernel alike) and the choice of CPU kernel; the kernels are in bias_gelu_kernels_impl.h.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>

#include "../common/cpu_isa.h"
#include "bias_gelu_kernels.h"

namespace ascendspeed::bias_gelu {
namespace {

// The one argument check of ascendspeed::bias_gelu. Every rejection names the argument at fault.
void check_bias_gelu(const char* op, const at::Tensor& y, const at::Tensor& bias) {
  TORCH_CHECK_VALUE(y.dim() > 0, op, ": y must have at least one dimension, got a 0-d tensor");
  const auto dtype = y.scalar_type();
  TORCH_CHECK_TYPE(
      dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
      op, ": y must be float32, bfloat16, float16 or float64, got ", dtype);
  TORCH_CHECK_TYPE(
      bias.scalar_type() == dtype, op, ": bias must have the dtype of y (", dtype, "), got ",
      bias.scalar_type());
  TORCH_CHECK_VALUE(
      bias.dim() == 1 && bias.sym_size(0) == y.sym_size(-1),
      op, ": bias must be one-dimensional with y.size(-1) = ", y.sym_size(-1), " elements, got shape ",
      bias.sym_sizes());
  TORCH_CHECK_VALUE(
      bias.device() == y.device(), op, ": bias must be on the device of y (", y.device(), "), got ",
      bias.device());
}

void check_bias_gelu_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& bias) {
  check_bias_gelu("bias_gelu_backward", y, bias);
  TORCH_CHECK_VALUE(
      grad.sym_sizes() == y.sym_sizes(), "bias_gelu_backward: grad must have the shape of y ",
      y.sym_sizes(), ", got ", grad.sym_sizes());
  TORCH_CHECK_TYPE(
      grad.scalar_type() == y.scalar_type(), "bias_gelu_backward: grad must have the dtype of y (",
      y.scalar_type(), "), got ", grad.scalar_type());
  TORCH_CHECK_VALUE(
      grad.device() == y.device(), "bias_gelu_backward: grad must be on the device of y (", y.device(),
      "), got ", grad.device());
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels& chosen =
      cpu::widest_kernels(cpu_kernels_avx512(), cpu_kernels_avx2(), cpu_kernels_default());
  return chosen;
}

// Outputs are contiguous; non-contiguous inputs are read through a contiguous copy.
at::Tensor bias_gelu_cpu(const at::Tensor& y, const at::Tensor& bias) {
  check_bias_gelu("bias_gelu", y, bias);
  const at::Tensor y_c = y.contiguous();
  const at::Tensor b_c = bias.contiguous();
  auto out = cpu::empty_output(y.sizes(), y.options());
  const int64_t len = y.size(-1);
  if (out.numel() > 0) {
    cpu_kernels().forward(y_c, b_c, out, out.numel() / len, len);
  }
  return out;
}

at::Tensor bias_gelu_backward_cpu(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& bias) {
  check_bias_gelu_backward(grad, y, bias);
  const at::Tensor g_c = grad.contiguous();
  const at::Tensor y_c = y.contiguous();
  const at::Tensor b_c = bias.contiguous();
  auto grad_y = cpu::empty_output(y.sizes(), y.options());
  const int64_t len = y.size(-1);
  if (grad_y.numel() > 0) {
    cpu_kernels().backward(g_c, y_c, b_c, grad_y, grad_y.numel() / len, len);
  }
  return grad_y;
}

at::Tensor bias_gelu_meta(const at::Tensor& y, const at::Tensor& bias) {
  check_bias_gelu("bias_gelu", y, bias);
  return at::empty_symint(y.sym_sizes(), y.options());
}

at::Tensor bias_gelu_backward_meta(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& bias) {
  check_bias_gelu_backward(grad, y, bias);
  return at::empty_symint(y.sym_sizes(), y.options());
}

std::string cpu_kernel() {
  return cpu::describe_kernels(cpu_kernels().isa);
}

} // namespace
} // namespace ascendspeed::bias_gelu

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.bias_gelu");
  m.def("bias_gelu(Tensor y, Tensor bias) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("bias_gelu_backward(Tensor grad, Tensor y, Tensor bias) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("_bias_gelu_cpu_kernel() -> str", &ascendspeed::bias_gelu::cpu_kernel);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("bias_gelu", &ascendspeed::bias_gelu::bias_gelu_cpu);
  m.impl("bias_gelu_backward", &ascendspeed::bias_gelu::bias_gelu_backward_cpu);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("bias_gelu", &ascendspeed::bias_gelu::bias_gelu_meta);
  m.impl("bias_gelu_backward", &ascendspeed::bias_gelu::bias_gelu_backward_meta);
}
