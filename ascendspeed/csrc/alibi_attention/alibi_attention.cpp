// ALiBi flash attention as torch operators:
//   ascendspeed::alibi_flash_attention(q, k, v, slopes, scale, q_offset) -> (out, logsumexp)
//   ascendspeed::alibi_flash_attention_backward(grad_out, q, k, v, out, logsumexp, slopes, scale, q_offset)
//       -> (grad_q, grad_k, grad_v)
// Causal attention over [batch, heads, seq, head_dim] tensors where head h adds
// -slopes[h] * (q_pos - k_pos) to its scaled scores, query row i sitting at position i + q_offset.
// The bias is generated inside the blockwise softmax, so the extra memory is O(batch * heads * sq)
// (the logsumexp backward needs), never O(sq * sk).
//
// This file owns the schemas, the argument checks (one function, used by the CPU and the Meta
// kernels), the memory layout and the choice of CPU kernel; the kernels are in
// alibi_attention_kernels_impl.h. Autograd and the kernels for other devices are registered from
// Python by ascendspeed/ops/alibi_flash_attention.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>

#include "../common/cpu_isa.h"
#include "alibi_attention_kernels.h"
#include "block_gemm.h"

namespace ascendspeed::alibi_attention {
namespace {

// Positions must stay exact integers in fp32, the dtype of the bias math.
constexpr int64_t kMaxExactPosition = int64_t{1} << 24;

void check_attention_tensor(const at::Tensor& t, const char* name, const at::Tensor& query) {
  TORCH_CHECK_VALUE(
      t.dim() == 4, "alibi_flash_attention: ", name, " must be [batch, heads, seq, head_dim], got shape ",
      t.sizes());
  TORCH_CHECK_TYPE(
      t.scalar_type() == query.scalar_type(), "alibi_flash_attention: ", name, " must have query's dtype ",
      query.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(
      t.device() == query.device(), "alibi_flash_attention: ", name, " must be on query's device ",
      query.device(), ", got ", t.device());
}

// The one argument check of both operators (forward and backward share their inputs).
void check_arguments(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK_TYPE(
      dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
      "alibi_flash_attention: query must be float32, bfloat16, float16 or float64, got ", dtype);
  check_attention_tensor(query, "query", query);
  check_attention_tensor(key, "key", query);
  check_attention_tensor(value, "value", query);
  TORCH_CHECK_VALUE(
      key.size(0) == query.size(0) && value.size(0) == query.size(0),
      "alibi_flash_attention: query, key and value must have the same batch size, got ", query.size(0), ", ",
      key.size(0), " and ", value.size(0));
  TORCH_CHECK_VALUE(
      key.size(1) == query.size(1) && value.size(1) == query.size(1),
      "alibi_flash_attention: query, key and value must have the same number of heads, got ", query.size(1),
      ", ", key.size(1), " and ", value.size(1),
      " (for grouped-query attention repeat key and value per group: key.repeat_interleave(groups, dim=1))");
  TORCH_CHECK_VALUE(
      key.size(2) == value.size(2), "alibi_flash_attention: key and value must have the same sequence length, got ",
      key.size(2), " and ", value.size(2));
  TORCH_CHECK_VALUE(
      query.size(3) > 0 && key.size(3) == query.size(3) && value.size(3) == query.size(3),
      "alibi_flash_attention: query, key and value must have the same non-zero head_dim, got ", query.size(3),
      ", ", key.size(3), " and ", value.size(3));
  TORCH_CHECK_VALUE(
      slopes.dim() == 1 && slopes.size(0) == query.size(1),
      "alibi_flash_attention: slopes must be a vector of one slope per head (", query.size(1), "), got shape ",
      slopes.sizes());
  TORCH_CHECK_TYPE(
      slopes.scalar_type() == at::kFloat, "alibi_flash_attention: slopes must be float32, got ",
      slopes.scalar_type());
  TORCH_CHECK_VALUE(
      slopes.device() == query.device(), "alibi_flash_attention: slopes must be on query's device ",
      query.device(), ", got ", slopes.device());
  TORCH_CHECK_VALUE(std::isfinite(scale), "alibi_flash_attention: scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(
      q_offset >= 0,
      "alibi_flash_attention: q_offset (the position of query row 0) must be >= 0 so that every query sees "
      "at least key 0, got ",
      q_offset);
  TORCH_CHECK_VALUE(
      q_offset + query.size(2) < kMaxExactPosition && key.size(2) < kMaxExactPosition,
      "alibi_flash_attention: positions beyond 2^24 are not exact in fp32 (sq=", query.size(2),
      ", sk=", key.size(2), ", q_offset=", q_offset, ")");
  TORCH_CHECK_VALUE(
      query.size(2) == 0 || key.size(2) > 0,
      "alibi_flash_attention: key and value are empty (sk=0) but there are ", query.size(2),
      " queries: each query needs at least one key to attend to");
}

void check_backward_arguments(
    const at::Tensor& grad_out,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& out,
    const at::Tensor& logsumexp,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset) {
  check_arguments(query, key, value, slopes, scale, q_offset);
  check_attention_tensor(grad_out, "grad_out", query);
  check_attention_tensor(out, "out", query);
  TORCH_CHECK_VALUE(
      grad_out.sizes() == query.sizes() && out.sizes() == query.sizes(),
      "alibi_flash_attention_backward: grad_out and out must have query's shape ", query.sizes(), ", got ",
      grad_out.sizes(), " and ", out.sizes());
  const auto lse_dtype = at::toOpMathType(query.scalar_type());
  TORCH_CHECK_VALUE(
      logsumexp.dim() == 3 && logsumexp.size(0) == query.size(0) && logsumexp.size(1) == query.size(1) &&
          logsumexp.size(2) == query.size(2),
      "alibi_flash_attention_backward: logsumexp must be [batch, heads, sq] as forward returned it, got shape ",
      logsumexp.sizes());
  TORCH_CHECK_TYPE(
      logsumexp.scalar_type() == lse_dtype, "alibi_flash_attention_backward: logsumexp must be ", lse_dtype,
      " as forward returned it, got ", logsumexp.scalar_type());
  TORCH_CHECK_VALUE(
      logsumexp.device() == query.device(), "alibi_flash_attention_backward: logsumexp must be on query's device");
}

// The layout the kernels read: unit-stride head_dim and rows at least head_dim apart (any batch,
// head and sequence strides otherwise, so permuted Megatron tensors are read where they lie).
at::Tensor kernel_layout(const at::Tensor& t) {
  const bool readable = t.stride(3) == 1 && t.stride(2) >= t.size(3);
  return readable ? t : t.contiguous();
}

at::Tensor empty_logsumexp(const at::Tensor& query) {
  return at::empty(
      {query.size(0), query.size(1), query.size(2)}, query.options().dtype(at::toOpMathType(query.scalar_type())));
}

std::tuple<at::Tensor, at::Tensor> forward_outputs(const at::Tensor& query) {
  return {at::empty_like(query), empty_logsumexp(query)};
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels& chosen =
      cpu::widest_kernels(cpu_kernels_avx512(), cpu_kernels_avx2(), cpu_kernels_default());
  return chosen;
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset) {
  check_arguments(query, key, value, slopes, scale, q_offset);
  const auto q = kernel_layout(query), k = kernel_layout(key), v = kernel_layout(value);
  auto [out, logsumexp] = forward_outputs(q);
  if (out.numel() > 0) {
    cpu_kernels().forward(q, k, v, slopes.contiguous(), scale, q_offset, out, logsumexp);
  }
  return {out, logsumexp};
}

std::tuple<at::Tensor, at::Tensor> forward_meta(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset) {
  check_arguments(query, key, value, slopes, scale, q_offset);
  return forward_outputs(kernel_layout(query));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_outputs(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v) {
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& out,
    const at::Tensor& logsumexp,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset) {
  check_backward_arguments(grad_out, query, key, value, out, logsumexp, slopes, scale, q_offset);
  const auto q = kernel_layout(query), k = kernel_layout(key), v = kernel_layout(value);
  auto [grad_q, grad_k, grad_v] = backward_outputs(q, k, v);
  if (q.numel() == 0) {
    grad_k.zero_();
    grad_v.zero_();
  } else if (k.numel() > 0) {
    cpu_kernels().backward(
        kernel_layout(grad_out), q, k, v, kernel_layout(out), logsumexp.contiguous(), slopes.contiguous(), scale,
        q_offset, grad_q, grad_k, grad_v);
  }
  return {grad_q, grad_k, grad_v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const at::Tensor& grad_out,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& out,
    const at::Tensor& logsumexp,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset) {
  check_backward_arguments(grad_out, query, key, value, out, logsumexp, slopes, scale, q_offset);
  return backward_outputs(kernel_layout(query), kernel_layout(key), kernel_layout(value));
}

// "AVX512, multi-threaded; bf16: bf16 dot products (oneDNN brgemm), AVX512-BF16 conversions": the
// kernels this process runs, for benchmarks and tests.
std::string cpu_kernel() {
  std::string bf16 = bf16_matmul_description();
  if (bf16_dot_products()) {
    bf16 += cpu_kernels().native_bf16_conversion() ? ", AVX512-BF16 conversions" : ", portable conversions";
  }
  return cpu::describe_kernels(cpu_kernels().isa) + "; bf16: " + bf16;
}

} // namespace

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.def(
      "alibi_flash_attention(Tensor query, Tensor key, Tensor value, Tensor slopes, float scale, "
      "int q_offset=0) -> (Tensor out, Tensor logsumexp)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "alibi_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor logsumexp, Tensor slopes, float scale, int q_offset) -> (Tensor grad_query, Tensor grad_key, "
      "Tensor grad_value)",
      {at::Tag::pt2_compliant_tag});
  m.def("_alibi_flash_attention_cpu_kernel() -> str", &ascendspeed::alibi_attention::cpu_kernel);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("alibi_flash_attention", &forward_cpu);
  m.impl("alibi_flash_attention_backward", &backward_cpu);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("alibi_flash_attention", &forward_meta);
  m.impl("alibi_flash_attention_backward", &backward_meta);
}

} // namespace ascendspeed::alibi_attention
