// Grouped linear layers as torch operators: the local experts of a mixture-of-experts layer, each a linear layer
// applied to its own contiguous block of the permuted tokens, in one operator call.
//
//   grouped_linear(x, weights, biases, m_splits) -> y
//       y[rows of group g] = x[rows of g] @ weights[g]^T (+ biases[g]); x is [sum(m_splits), in], weights[g]
//       [out, in], biases empty (no bias) or one [out] per group.
//   grouped_linear_input_grad(grad_y, weights, m_splits) -> grad_x
//       grad_x[rows of g] = grad_y[rows of g] @ weights[g].
//   grouped_linear_weight_grad(grad_y, x, m_splits, bias) -> (grad_weights, grad_biases)
//       grad_weights[g] = grad_y[rows of g]^T @ x[rows of g]; grad_biases[g] = the column sums of grad_y's rows
//       of g (an empty list without bias). A group without rows gets zeros.
//
// Each product is the one megatron-core's ColumnParallelLinear / RowParallelLinear take for a single expert
// (matmul with the transposed weight, the bias added after it, the weight gradient grad^T @ x), written into
// the group's rows of one output: a grouped layer takes the products SequentialMLP's per-expert layers take
// (their rounding can still differ in the last bit: a BLAS matmul's can depend on where a group's rows start).
//
// This file owns the schemas, the argument checks (shared by the CPU and the Meta kernels) and the CPU kernels;
// autograd and the kernels of other devices are registered by ascendspeed/ops/grouped_linear.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

namespace ascendspeed::grouped_linear {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// Checks the row blocks: one size per group, none negative, summing to the rows of `rows` (named `what`).
void check_splits(const char* op, const char* what, const at::Tensor& rows, at::IntArrayRef m_splits,
                  size_t groups) {
  TORCH_CHECK_VALUE(
      m_splits.size() == groups, op, ": m_splits must give one row count per group (", groups, " groups), got ",
      m_splits.size());
  int64_t total = 0;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    TORCH_CHECK_VALUE(m_splits[g] >= 0, op, ": m_splits[", g, "] = ", m_splits[g], " is negative");
    total += m_splits[g];
  }
  TORCH_CHECK_VALUE(
      total == rows.size(0), op, ": m_splits sums to ", total, " rows but ", what, " has ", rows.size(0), " rows");
}

void check_matrix(const char* op, const char* what, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": ", what, " must be 2-D, got ", t.dim(), " dimension(s)");
  TORCH_CHECK_TYPE(
      is_supported_float(t.scalar_type()), op, ": ", what, " must be float32, float64, bfloat16 or float16, got ",
      t.scalar_type());
}

// The weights: at least one group, every one [out, in] like the first, in the dtype and on the device of `x`.
void check_weights(const char* op, const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK_VALUE(!weights.empty(), op, ": weights must hold at least one group's weight");
  for (size_t g = 0; g < weights.size(); ++g) {
    const auto& w = weights[g];
    TORCH_CHECK_VALUE(w.dim() == 2, op, ": weights[", g, "] must be [out, in], got ", w.dim(), " dimension(s)");
    TORCH_CHECK_VALUE(
        w.sizes() == weights[0].sizes(), op, ": every group's weight must have weights[0]'s shape ",
        weights[0].sizes(), ", weights[", g, "] has ", w.sizes());
    TORCH_CHECK_TYPE(
        w.scalar_type() == x.scalar_type(), op, ": weights[", g, "] is ", w.scalar_type(), ", the input is ",
        x.scalar_type(), "; cast them to one dtype");
    TORCH_CHECK_VALUE(
        w.device() == x.device(), op, ": weights[", g, "] is on ", w.device(), ", the input on ", x.device());
  }
}

void check_forward(const at::Tensor& x, at::TensorList weights, at::TensorList biases, at::IntArrayRef m_splits) {
  constexpr const char* op = "grouped_linear";
  check_matrix(op, "x", x);
  check_weights(op, x, weights);
  TORCH_CHECK_VALUE(
      x.size(1) == weights[0].size(1), op, ": x has ", x.size(1), " features, the weights take ",
      weights[0].size(1), " (weights are [out, in])");
  TORCH_CHECK_VALUE(
      biases.empty() || biases.size() == weights.size(), op, ": biases must be empty (no bias) or one per group (",
      weights.size(), "), got ", biases.size());
  for (size_t g = 0; g < biases.size(); ++g) {
    TORCH_CHECK_VALUE(
        biases[g].dim() == 1 && biases[g].size(0) == weights[0].size(0), op, ": biases[", g, "] must be [",
        weights[0].size(0), "], got ", biases[g].sizes());
    TORCH_CHECK_TYPE(
        biases[g].scalar_type() == x.scalar_type() && biases[g].device() == x.device(), op, ": biases[", g,
        "] must have the input's dtype and device (", x.scalar_type(), ", ", x.device(), "), got ",
        biases[g].scalar_type(), ", ", biases[g].device());
  }
  check_splits(op, "x", x, m_splits, weights.size());
}

void check_input_grad(const at::Tensor& grad_y, at::TensorList weights, at::IntArrayRef m_splits) {
  constexpr const char* op = "grouped_linear_input_grad";
  check_matrix(op, "grad_y", grad_y);
  check_weights(op, grad_y, weights);
  TORCH_CHECK_VALUE(
      grad_y.size(1) == weights[0].size(0), op, ": grad_y has ", grad_y.size(1), " features, the weights give ",
      weights[0].size(0));
  check_splits(op, "grad_y", grad_y, m_splits, weights.size());
}

void check_weight_grad(const at::Tensor& grad_y, const at::Tensor& x, at::IntArrayRef m_splits) {
  constexpr const char* op = "grouped_linear_weight_grad";
  check_matrix(op, "grad_y", grad_y);
  check_matrix(op, "x", x);
  TORCH_CHECK_TYPE(
      grad_y.scalar_type() == x.scalar_type(), op, ": grad_y is ", grad_y.scalar_type(), ", x is ",
      x.scalar_type());
  TORCH_CHECK_VALUE(
      grad_y.size(0) == x.size(0), op, ": grad_y has ", grad_y.size(0), " rows, x has ", x.size(0));
  TORCH_CHECK_VALUE(!m_splits.empty(), op, ": m_splits must name at least one group");
  check_splits(op, "x", x, m_splits, m_splits.size());
}

// -- CPU kernels ----------------------------------------------------------------------------------------------

// Row offsets of the groups: group g's rows are [starts[g], starts[g + 1]).
std::vector<int64_t> group_starts(at::IntArrayRef m_splits) {
  std::vector<int64_t> starts(m_splits.size() + 1, 0);
  for (size_t g = 0; g < m_splits.size(); ++g) {
    starts[g + 1] = starts[g] + m_splits[g];
  }
  return starts;
}

// Runs `body(g)` for every group. With at least as many groups as threads the groups are divided over the
// threads and each product runs on one (a matmul called inside a parallel region keeps to its thread): many
// small products run better side by side than each one split over every thread. With fewer groups, one after
// another, each product on every thread.
template <typename Body>
void for_each_group(size_t groups, const Body& body) {
  if (groups >= static_cast<size_t>(at::get_num_threads()) && groups > 1) {
    // The ATen calls in the body dispatch as they would on the calling thread (below autograd, same modes).
    const at::ThreadLocalState caller_state;
    at::parallel_for(0, static_cast<int64_t>(groups), 1, [&](int64_t begin, int64_t end) {
      const at::ThreadLocalStateGuard state_guard(caller_state);
      for (int64_t g = begin; g < end; ++g) {
        body(static_cast<size_t>(g));
      }
    });
  } else {
    for (size_t g = 0; g < groups; ++g) {
      body(g);
    }
  }
}

at::Tensor grouped_linear_cpu(
    const at::Tensor& x, at::TensorList weights, at::TensorList biases, at::IntArrayRef m_splits) {
  check_forward(x, weights, biases, m_splits);
  auto y = at::empty({x.size(0), weights[0].size(0)}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto starts = group_starts(m_splits);
  for_each_group(weights.size(), [&](size_t g) {
    auto rows = y.narrow(0, starts[g], m_splits[g]);
    at::mm_out(rows, x.narrow(0, starts[g], m_splits[g]), weights[g].t());
    if (!biases.empty()) {
      rows.add_(biases[g]);
    }
  });
  return y;
}

at::Tensor grouped_linear_input_grad_cpu(
    const at::Tensor& grad_y, at::TensorList weights, at::IntArrayRef m_splits) {
  check_input_grad(grad_y, weights, m_splits);
  auto grad_x =
      at::empty({grad_y.size(0), weights[0].size(1)}, grad_y.options().memory_format(at::MemoryFormat::Contiguous));
  const auto starts = group_starts(m_splits);
  for_each_group(weights.size(), [&](size_t g) {
    auto rows = grad_x.narrow(0, starts[g], m_splits[g]);
    at::mm_out(rows, grad_y.narrow(0, starts[g], m_splits[g]), weights[g]);
  });
  return grad_x;
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_weight_grad_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, at::IntArrayRef m_splits, bool bias) {
  check_weight_grad(grad_y, x, m_splits);
  std::vector<at::Tensor> grad_weights(m_splits.size());
  std::vector<at::Tensor> grad_biases(bias ? m_splits.size() : 0);
  const auto starts = group_starts(m_splits);
  for_each_group(m_splits.size(), [&](size_t g) {
    const auto grad_rows = grad_y.narrow(0, starts[g], m_splits[g]);
    grad_weights[g] = at::mm(grad_rows.t(), x.narrow(0, starts[g], m_splits[g]));
    if (bias) {
      grad_biases[g] = grad_rows.sum(0);
    }
  });
  return {grad_weights, grad_biases};
}

// -- Meta kernels (FakeTensor, torch.compile) ------------------------------------------------------------------

at::Tensor grouped_linear_meta(
    const at::Tensor& x, at::TensorList weights, at::TensorList biases, at::IntArrayRef m_splits) {
  check_forward(x, weights, biases, m_splits);
  return at::empty({x.size(0), weights[0].size(0)}, x.options());
}

at::Tensor grouped_linear_input_grad_meta(
    const at::Tensor& grad_y, at::TensorList weights, at::IntArrayRef m_splits) {
  check_input_grad(grad_y, weights, m_splits);
  return at::empty({grad_y.size(0), weights[0].size(1)}, grad_y.options());
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> grouped_linear_weight_grad_meta(
    const at::Tensor& grad_y, const at::Tensor& x, at::IntArrayRef m_splits, bool bias) {
  check_weight_grad(grad_y, x, m_splits);
  std::vector<at::Tensor> grad_weights;
  std::vector<at::Tensor> grad_biases;
  for (size_t g = 0; g < m_splits.size(); ++g) {  // one tensor each: the gradients must not alias
    grad_weights.push_back(at::empty({grad_y.size(1), x.size(1)}, x.options()));
    if (bias) {
      grad_biases.push_back(at::empty({grad_y.size(1)}, x.options()));
    }
  }
  return {grad_weights, grad_biases};
}

}  // namespace

std::string cpu_kernel() {
  return "grouped_linear: C++, one ATen matmul per group written into the group's rows, groups divided over the "
         "threads (at::parallel_for) when there are at least as many";
}
}  // namespace ascendspeed::grouped_linear

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.grouped_linear");
  m.def(
      "grouped_linear(Tensor x, Tensor[] weights, Tensor[] biases, int[] m_splits) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "grouped_linear_input_grad(Tensor grad_y, Tensor[] weights, int[] m_splits) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "grouped_linear_weight_grad(Tensor grad_y, Tensor x, int[] m_splits, bool bias) -> (Tensor[], Tensor[])",
      {at::Tag::pt2_compliant_tag});
  m.def("_grouped_linear_cpu_kernel() -> str", &ascendspeed::grouped_linear::cpu_kernel);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("grouped_linear", &ascendspeed::grouped_linear::grouped_linear_cpu);
  m.impl("grouped_linear_input_grad", &ascendspeed::grouped_linear::grouped_linear_input_grad_cpu);
  m.impl("grouped_linear_weight_grad", &ascendspeed::grouped_linear::grouped_linear_weight_grad_cpu);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("grouped_linear", &ascendspeed::grouped_linear::grouped_linear_meta);
  m.impl("grouped_linear_input_grad", &ascendspeed::grouped_linear::grouped_linear_input_grad_meta);
  m.impl("grouped_linear_weight_grad", &ascendspeed::grouped_linear::grouped_linear_weight_grad_meta);
}
