// SwiGLU as torch operators: ascendspeed::swiglu(x, dim) = silu(a) * b where x = [a | b] is split in
// halves along dim (the gate a first, as Megatron's torch.chunk), and its backward
// ascendspeed::swiglu_backward(grad_y, x, dim) = grad_x, which needs only x: nothing else is saved.
// ascendspeed::weighted_swiglu(x, weights) scales each row by its routing probability in the same pass
// (megatron-core's weighted_bias_swiglu_impl for experts); its backward also returns grad_weights.
//
// This file owns the schemas, the one argument check of each operator (check_swiglu,
// check_swiglu_backward: called by the CPU and the Meta kernel alike), the memory layout and the choice
// of CPU kernel; the kernels are in swiglu_kernels_impl.h. FakeTensor and torch.compile use the Meta
// kernels below. Autograd and the CUDA / NPU kernels are registered from Python by
// ascendspeed/ops/swiglu.py; those kernels validate by running the Meta kernel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../common/cpu_isa.h"
#include "swiglu_kernels.h"

namespace ascendspeed::swiglu {
namespace {

// The one argument check of ascendspeed::swiglu; returns the wrapped split dimension. Every rejection
// names the argument at fault. Sizes are read as SymInts so FakeTensors with dynamic shapes pass.
int64_t check_swiglu(const at::Tensor& x, int64_t dim) {
  TORCH_CHECK_VALUE(x.dim() > 0, "swiglu: x must have at least one dimension, got a 0-d tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(
      dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
      "swiglu: x must be float32, bfloat16, float16 or float64, got ",
      dtype);
  TORCH_CHECK_INDEX(
      dim >= -x.dim() && dim < x.dim(),
      "swiglu: dim=",
      dim,
      " is out of range for x with ",
      x.dim(),
      " dimension(s) (expected ",
      -x.dim(),
      " <= dim <= ",
      x.dim() - 1,
      ")");
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  TORCH_CHECK_VALUE(
      x.sym_size(d) % 2 == 0,
      "swiglu: x.size(dim) must be even to split x into gate and value halves, got x.size(",
      dim,
      ") = ",
      x.sym_size(d));
  return d;
}

// The one argument check of ascendspeed::swiglu_backward: x as for swiglu, and grad_y shaped like
// swiglu(x, dim), of the dtype and on the device of x. Returns the wrapped split dimension.
int64_t check_swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x, int64_t dim) {
  const int64_t d = check_swiglu(x, dim);
  std::vector<c10::SymInt> expected = x.sym_sizes().vec();
  expected[d] = expected[d] / 2;
  TORCH_CHECK_VALUE(
      grad_y.sym_sizes() == c10::SymIntArrayRef(expected),
      "swiglu_backward: grad_y must have the shape of swiglu(x, dim) ",
      c10::SymIntArrayRef(expected),
      ", got ",
      grad_y.sym_sizes());
  TORCH_CHECK_TYPE(
      grad_y.scalar_type() == x.scalar_type(),
      "swiglu_backward: grad_y must have the dtype of x (",
      x.scalar_type(),
      "), got ",
      grad_y.scalar_type());
  TORCH_CHECK_VALUE(
      grad_y.device() == x.device(),
      "swiglu_backward: grad_y must be on the device of x (",
      x.device(),
      "), got ",
      grad_y.device(),
      "; move one of them");
  return d;
}

// The dimensions of x from outermost to innermost in memory, when x is dense in that order; else
// nullopt. A dense input in any order (transposed, channels-last) is then processed where it lies,
// and its output and gradient are laid out in the same order. The Meta kernels use the same rule, so
// torch.compile sees the strides the CPU kernel produces.
std::optional<std::vector<int64_t>> memory_order(const at::Tensor& x) {
  std::vector<int64_t> order(x.dim());
  std::iota(order.begin(), order.end(), 0);
  if (x.is_contiguous()) {
    return order;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) {
    return x.sym_stride(i) > x.sym_stride(j);
  });
  if (x.permute(order).is_contiguous()) {
    return order;
  }
  return std::nullopt;
}

// Strides of a tensor of `sizes` that is dense in `order` (outermost first).
std::vector<int64_t> dense_strides(at::IntArrayRef sizes, const std::vector<int64_t>& order) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    strides[*it] = stride;
    stride *= std::max<int64_t>(sizes[*it], 1);
  }
  return strides;
}

// How one call sees its input: x (a contiguous copy when the input is not dense), the memory
// order of x, and x as `rows` rows of [a | b] with halves of `len` contiguous elements.
struct Plan {
  at::Tensor x;
  std::vector<int64_t> order;
  int64_t rows = 1;
  int64_t len = 1;
  std::vector<int64_t> y_sizes;
};

// The memory order of x when it is dense, else row-major (the order of its contiguous copy).
std::vector<int64_t> output_order(const at::Tensor& x) {
  if (auto order = memory_order(x)) {
    return std::move(*order);
  }
  std::vector<int64_t> order(x.dim());
  std::iota(order.begin(), order.end(), 0);
  return order;
}

// An empty tensor of `sizes` dense in `order`: what the CPU kernels return, for the Meta kernels.
at::Tensor empty_meta_in_order(
    std::vector<c10::SymInt> sizes, const std::vector<int64_t>& order, const at::TensorOptions& options) {
  std::vector<c10::SymInt> strides(sizes.size());
  c10::SymInt stride = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    strides[*it] = stride;
    stride = stride * sizes[*it].max(1);
  }
  return at::empty_strided_symint(sizes, strides, options);
}

Plan make_plan(const at::Tensor& input, int64_t d) {
  Plan plan;
  if (auto order = memory_order(input)) {
    plan.x = input;
    plan.order = std::move(*order);
  } else {
    plan.x = input.contiguous();
    plan.order.resize(input.dim());
    std::iota(plan.order.begin(), plan.order.end(), 0);
  }
  const auto sizes = plan.x.sizes();
  const auto split = std::find(plan.order.begin(), plan.order.end(), d);
  for (auto it = plan.order.begin(); it != split; ++it) {
    plan.rows *= sizes[*it];
  }
  plan.len = sizes[d] / 2;
  for (auto it = split + 1; it != plan.order.end(); ++it) {
    plan.len *= sizes[*it];
  }
  plan.y_sizes = sizes.vec();
  plan.y_sizes[d] /= 2;
  return plan;
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels& chosen =
      cpu::widest_kernels(cpu_kernels_avx512(), cpu_kernels_avx2(), cpu_kernels_default());
  return chosen;
}

at::Tensor swiglu_cpu(const at::Tensor& input, int64_t dim) {
  const Plan plan = make_plan(input, check_swiglu(input, dim));
  auto y = cpu::empty_output(plan.y_sizes, dense_strides(plan.y_sizes, plan.order), plan.x.options());
  if (y.numel() > 0) {
    cpu_kernels().forward(plan.x, y, plan.rows, plan.len);
  }
  return y;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad_y, const at::Tensor& input, int64_t dim) {
  const Plan plan = make_plan(input, check_swiglu_backward(grad_y, input, dim));
  const auto y_strides = dense_strides(plan.y_sizes, plan.order);
  at::Tensor g = grad_y;
  if (!grad_y.permute(plan.order).is_contiguous()) {
    g = at::empty_strided(plan.y_sizes, y_strides, grad_y.options());
    g.copy_(grad_y);
  }
  auto grad_x =
      cpu::empty_output(plan.x.sizes(), dense_strides(plan.x.sizes(), plan.order), plan.x.options());
  if (grad_x.numel() > 0) {
    cpu_kernels().backward(g, plan.x, grad_x, plan.rows, plan.len);
  }
  return grad_x;
}

at::Tensor swiglu_meta(const at::Tensor& x, int64_t dim) {
  const int64_t d = check_swiglu(x, dim);
  std::vector<c10::SymInt> sizes = x.sym_sizes().vec();
  sizes[d] = sizes[d] / 2;
  return empty_meta_in_order(std::move(sizes), output_order(x), x.options());
}

at::Tensor swiglu_backward_meta(const at::Tensor& grad_y, const at::Tensor& x, int64_t dim) {
  check_swiglu_backward(grad_y, x, dim);
  return empty_meta_in_order(x.sym_sizes().vec(), output_order(x), x.options());
}

// -- weighted_swiglu: an expert's SwiGLU scaled by its tokens' routing probabilities ------------------
// ascendspeed::weighted_swiglu(x, weights) = silu(a) * b * weights over the last dimension of x, with
// weights of shape x.shape[:-1] + (1,) (megatron-core's per-token scale), in one pass rounded once to
// the dtype of x; its backward returns the gradients of x and of weights (in the dtype of weights).

// The one argument check of ascendspeed::weighted_swiglu.
void check_weighted_swiglu(const at::Tensor& x, const at::Tensor& weights) {
  TORCH_CHECK_VALUE(
      x.dim() > 0, "weighted_swiglu: x must have at least one dimension, got a 0-d tensor");
  check_swiglu(x, -1);
  const auto dtype = weights.scalar_type();
  TORCH_CHECK_TYPE(
      dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
      "weighted_swiglu: weights must be float32, bfloat16, float16 or float64, got ",
      dtype);
  std::vector<c10::SymInt> expected = x.sym_sizes().vec();
  expected.back() = 1;
  TORCH_CHECK_VALUE(
      weights.sym_sizes() == c10::SymIntArrayRef(expected),
      "weighted_swiglu: weights must have shape x.shape[:-1] + (1,) = ",
      c10::SymIntArrayRef(expected),
      " (one routing probability per row of x), got ",
      weights.sym_sizes());
  TORCH_CHECK_VALUE(
      weights.device() == x.device(),
      "weighted_swiglu: weights must be on the device of x (",
      x.device(),
      "), got ",
      weights.device(),
      "; move one of them");
}

void check_weighted_swiglu_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weights) {
  check_weighted_swiglu(x, weights);
  check_swiglu_backward(grad_y, x, -1);
}

// The kernels' math type: float, double for double inputs; the weights are read in it.
at::ScalarType weighted_opmath(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

struct WeightedPlan {
  at::Tensor x;
  at::Tensor w;  // one opmath value per row, contiguous
  int64_t rows = 1;
  int64_t len = 0;
  std::vector<int64_t> y_sizes;
};

WeightedPlan make_weighted_plan(const at::Tensor& input, const at::Tensor& weights) {
  WeightedPlan plan;
  plan.x = input.contiguous();
  plan.w = weights.to(weighted_opmath(input)).contiguous();
  plan.y_sizes = input.sizes().vec();
  plan.y_sizes.back() /= 2;
  plan.len = plan.y_sizes.back();
  plan.rows = weights.numel();
  return plan;
}

at::Tensor weighted_swiglu_cpu(const at::Tensor& input, const at::Tensor& weights) {
  check_weighted_swiglu(input, weights);
  const WeightedPlan plan = make_weighted_plan(input, weights);
  auto y = cpu::empty_output(plan.y_sizes, plan.x.options());
  if (y.numel() > 0) {
    cpu_kernels().weighted_forward(plan.x, plan.w, y, plan.rows, plan.len);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> weighted_swiglu_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& input, const at::Tensor& weights) {
  check_weighted_swiglu_backward(grad_y, input, weights);
  const WeightedPlan plan = make_weighted_plan(input, weights);
  const at::Tensor g = grad_y.contiguous();
  auto grad_x = cpu::empty_output(plan.x.sizes(), plan.x.options());
  auto grad_w = at::zeros({plan.rows}, plan.w.options());
  if (grad_x.numel() > 0) {
    cpu_kernels().weighted_backward(g, plan.x, plan.w, grad_x, grad_w, plan.rows, plan.len);
  }
  return {grad_x, grad_w.to(weights.scalar_type()).view(weights.sizes())};
}

at::Tensor weighted_swiglu_meta(const at::Tensor& x, const at::Tensor& weights) {
  check_weighted_swiglu(x, weights);
  std::vector<c10::SymInt> sizes = x.sym_sizes().vec();
  sizes.back() = sizes.back() / 2;
  return at::empty_symint(sizes, x.options());
}

std::tuple<at::Tensor, at::Tensor> weighted_swiglu_backward_meta(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weights) {
  check_weighted_swiglu_backward(grad_y, x, weights);
  return {
      at::empty_symint(x.sym_sizes(), x.options()),
      at::empty_symint(weights.sym_sizes(), weights.options())};
}

std::string cpu_kernel() {
  return cpu::describe_kernels(cpu_kernels().isa);
}

} // namespace
} // namespace ascendspeed::swiglu

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.swiglu");
  m.def("swiglu(Tensor x, int dim=-1) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def(
      "swiglu_backward(Tensor grad_y, Tensor x, int dim=-1) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def("weighted_swiglu(Tensor x, Tensor weights) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def(
      "weighted_swiglu_backward(Tensor grad_y, Tensor x, Tensor weights) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("_swiglu_cpu_kernel() -> str", &ascendspeed::swiglu::cpu_kernel);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("swiglu", &ascendspeed::swiglu::swiglu_cpu);
  m.impl("swiglu_backward", &ascendspeed::swiglu::swiglu_backward_cpu);
  m.impl("weighted_swiglu", &ascendspeed::swiglu::weighted_swiglu_cpu);
  m.impl("weighted_swiglu_backward", &ascendspeed::swiglu::weighted_swiglu_backward_cpu);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("swiglu", &ascendspeed::swiglu::swiglu_meta);
  m.impl("swiglu_backward", &ascendspeed::swiglu::swiglu_backward_meta);
  m.impl("weighted_swiglu", &ascendspeed::swiglu::weighted_swiglu_meta);
  m.impl("weighted_swiglu_backward", &ascendspeed::swiglu::weighted_swiglu_backward_meta);
}
