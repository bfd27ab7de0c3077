// MoE token permutation as torch operators: the rearrangements megatron-core's MoE token dispatchers run
// around the experts, each one pass over memory.
//
//   moe_permute_index(routing_map, num_out_tokens) -> row_id_map
//       The rows of the permuted tokens: expert by expert, tokens ascending within an expert (the order of
//       megatron-core's argsort over the transposed routing map), each row named by e * num_tokens + t, so
//       one int64 per row carries both the token and the expert. A counting pass, no sort.
//   moe_gather(x, row_id_map, probs?) -> out[r] = x[t(r)] (* probs[t(r), e(r)])
//       The permutation (no probs), and the gradient of moe_scatter_add.
//   moe_scatter_add(y, row_id_map, probs?, num_tokens) -> out[t] = sum over rows r of t of y[r] (* probs[t, e(r)])
//       The unpermutation (probs: the routing weights merged on the way back), and the gradient of moe_gather.
//   moe_sort_chunks(x, split_sizes, sorted_idxs) -> x's row chunks in the order sorted_idxs names
//       The alltoall dispatcher's regrouping of received chunks by local expert.
//
// Numerics are megatron-core's unfused path to the bit: products with probs are taken in the promoted dtype
// of (x, probs) and rounded there; sums over a token's rows run in row order from zero, in float for
// bfloat16 / float16 as scatter_add / index_add accumulate, and are rounded to the input dtype once.
//
// This file owns the schemas, the argument checks (shared by the CPU and the Meta kernels) and the CPU
// operators; their row loops are compiled once per instruction set (moe_permute_kernels.h). Autograd and
// the kernels of other devices are registered by ascendspeed/ops/moe_permute.py.
#include "moe_permute_kernels.h"
#include "../common/cpu_isa.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/promote_types.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace ascendspeed::moe_permute {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// -- checks -------------------------------------------------------------------------------------------------

void check_routing_map(const at::Tensor& routing_map, int64_t num_out_tokens) {
  TORCH_CHECK_VALUE(
      routing_map.dim() == 2, "moe_permute_index: routing_map must be [num_tokens, num_experts], got ",
      routing_map.dim(), " dimension(s)");
  const auto t = routing_map.scalar_type();
  TORCH_CHECK_TYPE(
      t == at::kBool || at::isIntegralType(t, /*includeBool=*/false),
      "moe_permute_index: routing_map must be bool or an integer type (non-zero: routed), got ", t);
  TORCH_CHECK_VALUE(num_out_tokens >= 0, "moe_permute_index: num_out_tokens must be >= 0, got ", num_out_tokens);
}

void check_rows(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": ", name, " must have a row dimension, got a 0-d tensor");
  TORCH_CHECK_TYPE(
      is_supported_float(x.scalar_type()), op, ": ", name, " must be float32, float64, bfloat16 or float16, got ",
      x.scalar_type());
}

void check_row_id_map(const char* op, const at::Tensor& row_id_map, const at::Tensor& x) {
  TORCH_CHECK_VALUE(
      row_id_map.dim() == 1 && row_id_map.scalar_type() == at::kLong, op,
      ": row_id_map must be the 1-d int64 tensor moe_permute_index returns, got ", row_id_map.scalar_type(), " with ",
      row_id_map.dim(), " dimension(s)");
  TORCH_CHECK_VALUE(
      row_id_map.device() == x.device(), op, ": row_id_map must be on the device of the tokens (", x.device(),
      "), got ", row_id_map.device());
}

void check_probs(const char* op, const std::optional<at::Tensor>& probs, const at::Tensor& x, int64_t num_tokens) {
  if (!probs.has_value()) {
    return;
  }
  TORCH_CHECK_VALUE(
      probs->dim() == 2 && probs->sym_size(0) == num_tokens, op,
      ": probs must be [num_tokens, num_experts] with num_tokens = ", num_tokens, ", got ", probs->sym_sizes());
  TORCH_CHECK_TYPE(
      is_supported_float(probs->scalar_type()), op, ": probs must be float32, float64, bfloat16 or float16, got ",
      probs->scalar_type());
  TORCH_CHECK_VALUE(
      probs->device() == x.device(), op, ": probs must be on the device of the tokens (", x.device(), "), got ",
      probs->device());
}

std::vector<c10::SymInt> with_rows(const at::Tensor& x, c10::SymInt rows) {
  std::vector<c10::SymInt> sizes = x.sym_sizes().vec();
  sizes[0] = std::move(rows);
  return sizes;
}

// The row-id range a map may hold: e * num_tokens + t with t < num_tokens and, with probs, e < num_experts.
void check_row_ids(
    const char* op, const at::Tensor& row_id_map, int64_t num_tokens, const std::optional<at::Tensor>& probs) {
  const int64_t* ids = row_id_map.const_data_ptr<int64_t>();
  const int64_t n = row_id_map.numel();
  const int64_t bound = probs.has_value() ? num_tokens * probs->size(1) : INT64_MAX;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_INDEX(
        ids[r] >= 0 && ids[r] < bound, op, ": row_id_map[", r, "] = ", ids[r], " is not a row of ", num_tokens,
        " tokens", probs.has_value() ? " and the experts of probs" : "", " (expected 0 <= id < ", bound,
        "); pass the map moe_permute_index returned for these tokens");
  }
}

// -- kernels ------------------------------------------------------------------------------------------------

at::Tensor permute_index_cpu(const at::Tensor& routing_map_in, int64_t num_out_tokens) {
  check_routing_map(routing_map_in, num_out_tokens);
  const at::Tensor routing_map = routing_map_in.ne(0).contiguous();  // bool, row-major [T, E]
  const int64_t tokens = routing_map.size(0);
  const int64_t experts = routing_map.size(1);
  const bool* map = routing_map.const_data_ptr<bool>();

  std::vector<int64_t> per_expert(experts, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      per_expert[e] += map[t * experts + e];
    }
  }
  int64_t routed = 0;
  std::vector<int64_t> start(experts);
  for (int64_t e = 0; e < experts; ++e) {
    start[e] = routed;
    routed += per_expert[e];
  }
  TORCH_CHECK_VALUE(
      num_out_tokens <= routed, "moe_permute_index: num_out_tokens = ", num_out_tokens, " is more than the ",
      routed, " (token, expert) pairs routing_map routes; pass at most routing_map.sum()");

  at::Tensor row_id_map = at::empty({num_out_tokens}, routing_map.options().dtype(at::kLong));
  int64_t* ids = row_id_map.mutable_data_ptr<int64_t>();
  at::parallel_for(0, experts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      int64_t row = start[e];
      for (int64_t t = 0; t < tokens && row < num_out_tokens; ++t) {
        if (map[t * experts + e]) {
          ids[row++] = e * tokens + t;
        }
      }
    }
  });
  return row_id_map;
}

// Row width of x: elements per row (every dimension but the first).
int64_t row_width(const at::Tensor& x) {
  return x.size(0) == 0 ? 0 : x.numel() / x.size(0);
}

// The promoted dtype of (x, probs), where products with probs are taken (megatron-core's unfused path).
at::ScalarType compute_type(const at::Tensor& x, const std::optional<at::Tensor>& probs) {
  return probs.has_value() ? at::promote_types(x.scalar_type(), probs->scalar_type()) : x.scalar_type();
}

// The probs of each row, as the compute type (one scalar per row).
at::Tensor row_probs(const at::Tensor& row_id_map, int64_t num_tokens, const at::Tensor& probs, at::ScalarType acc) {
  const at::Tensor p = probs.to(acc).contiguous();
  at::Tensor out = at::empty({row_id_map.numel()}, p.options());
  const int64_t experts = p.size(1);
  const int64_t* ids = row_id_map.const_data_ptr<int64_t>();
  const int64_t element = p.element_size();
  const char* from = static_cast<const char*>(p.const_data_ptr());
  char* to = static_cast<char*>(out.mutable_data_ptr());
  for (int64_t r = 0; r < row_id_map.numel(); ++r) {
    const int64_t t = ids[r] % num_tokens;
    const int64_t e = ids[r] / num_tokens;
    std::memcpy(to + r * element, from + (t * experts + e) * element, element);
  }
  return out;
}

RowsOfTokens rows_of_tokens(const int64_t* ids, int64_t n, int64_t num_tokens) {
  RowsOfTokens index{std::vector<int64_t>(num_tokens + 1, 0), std::vector<int64_t>(n)};
  for (int64_t r = 0; r < n; ++r) {
    ++index.start[ids[r] % num_tokens + 1];
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    index.start[t + 1] += index.start[t];
  }
  std::vector<int64_t> next(index.start.begin(), index.start.end() - 1);
  for (int64_t r = 0; r < n; ++r) {
    index.rows[next[ids[r] % num_tokens]++] = r;
  }
  return index;
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels& kernels =
      cpu::widest_kernels(cpu_kernels_avx512(), cpu_kernels_avx2(), cpu_kernels_default());
  return kernels;
}

at::Tensor gather_cpu(const at::Tensor& x_in, const at::Tensor& row_id_map_in, const std::optional<at::Tensor>& probs) {
  check_rows("moe_gather", "x", x_in);
  check_row_id_map("moe_gather", row_id_map_in, x_in);
  check_probs("moe_gather", probs, x_in, x_in.size(0));
  const at::Tensor x = x_in.contiguous();
  const at::Tensor row_id_map = row_id_map_in.contiguous();
  const int64_t num_tokens = x.size(0);
  const int64_t rows = row_id_map.numel();
  TORCH_CHECK_VALUE(
      num_tokens > 0 || rows == 0, "moe_gather: x has no rows, but row_id_map names ", rows, " rows of it");
  check_row_ids("moe_gather", row_id_map, num_tokens, probs);
  at::Tensor out = at::empty_symint(with_rows(x, rows), x.options());
  if (out.numel() == 0) {
    return out;
  }
  const RowsOfTokens index = rows_of_tokens(row_id_map.const_data_ptr<int64_t>(), rows, num_tokens);
  const at::Tensor p =
      probs.has_value() ? row_probs(row_id_map, num_tokens, *probs, compute_type(x, probs)) : at::Tensor();
  cpu_kernels().gather_rows(x, p, index, out);
  return out;
}

at::Tensor scatter_add_cpu(
    const at::Tensor& y_in, const at::Tensor& row_id_map_in, const std::optional<at::Tensor>& probs,
    int64_t num_tokens) {
  check_rows("moe_scatter_add", "y", y_in);
  check_row_id_map("moe_scatter_add", row_id_map_in, y_in);
  TORCH_CHECK_VALUE(
      row_id_map_in.numel() == y_in.size(0), "moe_scatter_add: y must have one row per entry of row_id_map (",
      row_id_map_in.numel(), "), got ", y_in.size(0));
  TORCH_CHECK_VALUE(
      num_tokens > 0 || y_in.size(0) == 0, "moe_scatter_add: num_tokens must be > 0 when y has rows, got ",
      num_tokens);
  check_probs("moe_scatter_add", probs, y_in, num_tokens);
  const at::Tensor y = y_in.contiguous();
  const at::Tensor row_id_map = row_id_map_in.contiguous();
  check_row_ids("moe_scatter_add", row_id_map, num_tokens, probs);
  at::Tensor out = at::empty_symint(with_rows(y, num_tokens), y.options());
  if (out.numel() == 0) {
    return out;
  }
  const RowsOfTokens index = rows_of_tokens(row_id_map.const_data_ptr<int64_t>(), row_id_map.numel(), num_tokens);
  const at::Tensor p =
      probs.has_value() ? row_probs(row_id_map, num_tokens, *probs, compute_type(y, probs)) : at::Tensor();
  cpu_kernels().scatter_add_rows(y, p, index, out);
  return out;
}

// The chunk starts of x and the checked permutation: chunk sorted_idxs[i] of x is chunk i of the output.
struct Chunks {
  std::vector<int64_t> sizes;
  std::vector<int64_t> order;
};

Chunks check_chunks(const at::Tensor& x, const at::Tensor& split_sizes, const at::Tensor& sorted_idxs) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "moe_sort_chunks: x must have a row dimension, got a 0-d tensor");
  TORCH_CHECK_VALUE(
      split_sizes.dim() == 1 && sorted_idxs.dim() == 1 && split_sizes.numel() == sorted_idxs.numel(),
      "moe_sort_chunks: split_sizes and sorted_idxs must be 1-d and of one length, got ", split_sizes.sizes(),
      " and ", sorted_idxs.sizes());
  TORCH_CHECK_TYPE(
      at::isIntegralType(split_sizes.scalar_type(), false) && at::isIntegralType(sorted_idxs.scalar_type(), false),
      "moe_sort_chunks: split_sizes and sorted_idxs must be integer tensors, got ", split_sizes.scalar_type(), " and ",
      sorted_idxs.scalar_type());
  Chunks chunks;
  const at::Tensor sizes = split_sizes.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor order = sorted_idxs.to(at::kCPU, at::kLong).contiguous();
  chunks.sizes.assign(sizes.const_data_ptr<int64_t>(), sizes.const_data_ptr<int64_t>() + sizes.numel());
  chunks.order.assign(order.const_data_ptr<int64_t>(), order.const_data_ptr<int64_t>() + order.numel());
  int64_t total = 0;
  for (int64_t s : chunks.sizes) {
    TORCH_CHECK_VALUE(s >= 0, "moe_sort_chunks: split_sizes must be >= 0, got ", s);
    total += s;
  }
  TORCH_CHECK_VALUE(
      total == x.size(0), "moe_sort_chunks: split_sizes must add up to x.size(0) = ", x.size(0), ", got ", total);
  std::vector<bool> seen(chunks.order.size(), false);
  for (int64_t i : chunks.order) {
    TORCH_CHECK_VALUE(
        i >= 0 && i < static_cast<int64_t>(seen.size()) && !seen[i],
        "moe_sort_chunks: sorted_idxs must be a permutation of 0..", seen.size() - 1, ", got ", sorted_idxs);
    seen[i] = true;
  }
  return chunks;
}

at::Tensor sort_chunks_cpu(const at::Tensor& x_in, const at::Tensor& split_sizes, const at::Tensor& sorted_idxs) {
  const Chunks chunks = check_chunks(x_in, split_sizes, sorted_idxs);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t n = static_cast<int64_t>(chunks.sizes.size());
  std::vector<int64_t> source_start(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    source_start[i + 1] = source_start[i] + chunks.sizes[i];
  }
  std::vector<int64_t> target_start(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    target_start[i + 1] = target_start[i] + chunks.sizes[chunks.order[i]];
  }
  const int64_t row_bytes = row_width(x) * x.element_size();
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = chunks.order[i];
      std::memcpy(
          dst + target_start[i] * row_bytes, src + source_start[chunk] * row_bytes, chunks.sizes[chunk] * row_bytes);
    }
  });
  return out;
}

// -- Meta kernels (FakeTensor, torch.compile) ----------------------------------------------------------------

at::Tensor permute_index_meta(const at::Tensor& routing_map, int64_t num_out_tokens) {
  check_routing_map(routing_map, num_out_tokens);
  return at::empty({num_out_tokens}, routing_map.options().dtype(at::kLong));
}

at::Tensor gather_meta(const at::Tensor& x, const at::Tensor& row_id_map, const std::optional<at::Tensor>& probs) {
  check_rows("moe_gather", "x", x);
  check_row_id_map("moe_gather", row_id_map, x);
  check_probs("moe_gather", probs, x, x.size(0));
  return at::empty_symint(with_rows(x, row_id_map.sym_numel()), x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor scatter_add_meta(
    const at::Tensor& y, const at::Tensor& row_id_map, const std::optional<at::Tensor>& probs, int64_t num_tokens) {
  check_rows("moe_scatter_add", "y", y);
  check_row_id_map("moe_scatter_add", row_id_map, y);
  check_probs("moe_scatter_add", probs, y, num_tokens);
  return at::empty_symint(with_rows(y, num_tokens), y.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor sort_chunks_meta(const at::Tensor& x, const at::Tensor& split_sizes, const at::Tensor& sorted_idxs) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "moe_sort_chunks: x must have a row dimension, got a 0-d tensor");
  return at::empty_like(x, x.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

std::string cpu_kernel() {
  return cpu::describe_kernels(cpu_kernels().isa);
}
}  // namespace ascendspeed::moe_permute

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.moe_permute");
  m.def("moe_permute_index(Tensor routing_map, int num_out_tokens) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("moe_gather(Tensor x, Tensor row_id_map, Tensor? probs=None) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def(
      "moe_scatter_add(Tensor y, Tensor row_id_map, Tensor? probs, int num_tokens) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def("moe_sort_chunks(Tensor x, Tensor split_sizes, Tensor sorted_idxs) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("_moe_permute_cpu_kernel() -> str", &ascendspeed::moe_permute::cpu_kernel);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("moe_permute_index", &ascendspeed::moe_permute::permute_index_cpu);
  m.impl("moe_gather", &ascendspeed::moe_permute::gather_cpu);
  m.impl("moe_scatter_add", &ascendspeed::moe_permute::scatter_add_cpu);
  m.impl("moe_sort_chunks", &ascendspeed::moe_permute::sort_chunks_cpu);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("moe_permute_index", &ascendspeed::moe_permute::permute_index_meta);
  m.impl("moe_gather", &ascendspeed::moe_permute::gather_meta);
  m.impl("moe_scatter_add", &ascendspeed::moe_permute::scatter_add_meta);
  m.impl("moe_sort_chunks", &ascendspeed::moe_permute::sort_chunks_meta);
}
