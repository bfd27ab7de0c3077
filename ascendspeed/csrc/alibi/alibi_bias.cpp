// ALiBi (Press et al., "Train Short, Test Long", arXiv 2108.12409): add the linear position bias
// -slope[h] * distance(q, k) to attention scores in place, so no [heads, sq, sk] bias tensor is
// ever built.
//
// Positions are absolute: query row i sits at position i + q_offset and key column j at j, so a
// query block shorter than the key block (decoding with a KV cache, chunked prefill) is biased by
// its true distance. The causal form uses distance = q_pos - k_pos (its values beyond the diagonal
// are masked afterwards); the symmetric form uses |q_pos - k_pos|, for non-causal attention.
//
// The CPU kernels (alibi_bias_kernels_impl.h) are compiled per instruction set; this file holds the
// schema, the one argument check and the choice of kernels.
#include "alibi_bias_kernels.h"
#include "../common/cpu_isa.h"

#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <string>

namespace ascendspeed::alibi {
namespace {

// Integer distances stay exact in fp32 below 2^24.
constexpr int64_t kMaxExactPosition = int64_t{1} << 24;

const CpuKernels& cpu_kernels() {
  static const CpuKernels& chosen =
      cpu::widest_kernels(cpu_kernels_avx512(), cpu_kernels_avx2(), cpu_kernels_default());
  return chosen;
}

// The one argument check of ascendspeed::alibi_bias_, called by the CPU and the Meta kernel (and so by
// the Python CUDA / NPU kernels, which run the Meta kernel first). Like torch's in-place ops it refuses
// scores whose elements share memory (an expanded tensor would receive the bias several times).
void check_alibi_bias(const at::Tensor& scores, const at::Tensor& slopes, int64_t q_offset) {
  TORCH_CHECK_VALUE(
      scores.dim() == 3 || scores.dim() == 4,
      "alibi_bias_: scores must be [heads, sq, sk] or [batch, heads, sq, sk], got shape ", scores.sym_sizes());
  TORCH_CHECK_TYPE(
      at::isFloatingType(scores.scalar_type()),
      "alibi_bias_: scores must be float32, bfloat16, float16 or float64, got ", scores.scalar_type());
  const c10::SymInt& heads = scores.sym_size(-3);
  TORCH_CHECK_VALUE(
      slopes.dim() == 1 && slopes.sym_size(0) == heads,
      "alibi_bias_: slopes must be a vector of one slope per head (", heads, "), got shape ", slopes.sym_sizes());
  TORCH_CHECK_TYPE(
      slopes.scalar_type() == at::kFloat, "alibi_bias_: slopes must be float32, got ", slopes.scalar_type());
  TORCH_CHECK_VALUE(
      slopes.device() == scores.device(),
      "alibi_bias_: slopes must be on the device of scores (", scores.device(), "), got ", slopes.device(),
      "; move them with slopes.to(scores.device)");
  at::assert_no_internal_overlap(scores);
  if (!scores.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {  // torch's pairwise test needs sizes
    at::assert_no_overlap(scores, slopes);
  }
  const c10::SymInt& sq = scores.sym_size(-2);
  const c10::SymInt& sk = scores.sym_size(-1);
  TORCH_CHECK_VALUE(
      q_offset > -kMaxExactPosition && q_offset < kMaxExactPosition && q_offset + sq < kMaxExactPosition &&
          sk < kMaxExactPosition,
      "alibi_bias_: query positions [q_offset, q_offset + sq) and key positions [0, sk) must lie within "
      "(-2^24, 2^24), where fp32 distances are exact; got q_offset=", q_offset, ", sq=", sq, ", sk=", sk);
}

void alibi_bias_cpu_(const at::Tensor& scores, const at::Tensor& slopes, int64_t q_offset, bool symmetric) {
  check_alibi_bias(scores, slopes, q_offset);
  if (scores.numel() == 0) {
    return;
  }

  const at::Tensor slopes_c = slopes.contiguous();
  cpu_kernels().add_bias(scores, slopes_c.data_ptr<float>(), q_offset, symmetric);
}

// FakeTensor / torch.compile: nothing to compute, everything to check.
void alibi_bias_meta_(const at::Tensor& scores, const at::Tensor& slopes, int64_t q_offset, bool /*symmetric*/) {
  check_alibi_bias(scores, slopes, q_offset);
}

std::string cpu_kernel() {
  return cpu::describe_kernels(cpu_kernels().isa);
}

}  // namespace
}  // namespace ascendspeed::alibi

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.alibi");
  m.def(
      "alibi_bias_(Tensor(a!) scores, Tensor slopes, int q_offset=0, bool symmetric=False) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def("_alibi_bias_cpu_kernel() -> str", &ascendspeed::alibi::cpu_kernel);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("alibi_bias_", &ascendspeed::alibi::alibi_bias_cpu_);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("alibi_bias_", &ascendspeed::alibi::alibi_bias_meta_);
}
