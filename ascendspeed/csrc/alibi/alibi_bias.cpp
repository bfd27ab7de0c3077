// ALiBi (Press et al., "Train Short, Test Long", arXiv 2108.12409): add the linear position bias
// -slope[h] * distance(q, k) to attention scores in place, so no [heads, sq, sk] bias tensor is
// ever built.
//
// Positions are absolute: query row i sits at position i + q_offset and key column j at j, so a
// query block shorter than the key block (decoding with a KV cache, chunked prefill) is biased by
// its true distance. The causal form uses distance = q_pos - k_pos (its values beyond the diagonal
// are masked afterwards); the symmetric form uses |q_pos - k_pos|, for non-causal attention.
//
// The bias is computed in opmath (fp32; fp64 for double scores) whatever the score dtype: the
// distance is an exact integer and the bias is a single rounding of slope * distance, added to the
// score before the one rounding back to the score dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

namespace ascendspeed {
namespace {

using at::vec::Vectorized;

// Integer distances stay exact in fp32 below 2^24.
constexpr int64_t kMaxExactPosition = int64_t{1} << 24;

template <typename opmath_t>
inline opmath_t scalar_bias(opmath_t neg_slope, int64_t q_pos, int64_t k, bool symmetric) {
  int64_t distance = q_pos - k;
  if (symmetric) {
    distance = std::llabs(distance);
  }
  return neg_slope * static_cast<opmath_t>(distance);
}

template <typename opmath_t>
inline Vectorized<opmath_t> vector_bias(
    const Vectorized<opmath_t>& neg_slope,
    const Vectorized<opmath_t>& q_pos,
    const Vectorized<opmath_t>& k,
    bool symmetric) {
  auto distance = q_pos - k;
  if (symmetric) {
    distance = distance.abs();
  }
  return neg_slope * distance;
}

// fp32 / fp64 scores: the bias is computed in the score dtype itself.
template <typename scalar_t>
void add_bias_row(scalar_t* row, int64_t sk, scalar_t neg_slope, int64_t q_pos, bool symmetric) {
  using Vec = Vectorized<scalar_t>;
  constexpr int64_t kWidth = Vec::size();
  const Vec neg_slope_vec(neg_slope);
  const Vec q_pos_vec(static_cast<scalar_t>(q_pos));
  const Vec step(static_cast<scalar_t>(kWidth));
  Vec k_vec = Vec::arange(scalar_t(0), scalar_t(1));
  int64_t j = 0;
  for (; j + kWidth <= sk; j += kWidth) {
    const Vec scores = Vec::loadu(row + j);
    (scores + vector_bias(neg_slope_vec, q_pos_vec, k_vec, symmetric)).store(row + j);
    k_vec = k_vec + step;
  }
  for (; j < sk; ++j) {
    row[j] += scalar_bias(neg_slope, q_pos, j, symmetric);
  }
}

// bf16 / fp16 scores: widen to fp32, add, round once on the way back.
template <typename scalar_t>
void add_bias_row_reduced(scalar_t* row, int64_t sk, float neg_slope, int64_t q_pos, bool symmetric) {
  using Vec = Vectorized<scalar_t>;
  using FVec = Vectorized<float>;
  constexpr int64_t kWidth = Vec::size();
  static_assert(kWidth == 2 * FVec::size(), "a reduced-precision vector widens to two float vectors");
  const FVec neg_slope_vec(neg_slope);
  const FVec q_pos_vec(static_cast<float>(q_pos));
  const FVec half_step(static_cast<float>(FVec::size()));
  const FVec step(static_cast<float>(kWidth));
  FVec k_lo = FVec::arange(0.f, 1.f);
  int64_t j = 0;
  for (; j + kWidth <= sk; j += kWidth) {
    auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vec::loadu(row + j));
    const FVec k_hi = k_lo + half_step;
    lo = lo + vector_bias(neg_slope_vec, q_pos_vec, k_lo, symmetric);
    hi = hi + vector_bias(neg_slope_vec, q_pos_vec, k_hi, symmetric);
    at::vec::convert_from_float<scalar_t>(lo, hi).store(row + j);
    k_lo = k_lo + step;
  }
  for (; j < sk; ++j) {
    row[j] = static_cast<scalar_t>(static_cast<float>(row[j]) + scalar_bias(neg_slope, q_pos, j, symmetric));
  }
}

// Any layout whose last dimension is not unit-stride: plain loop in opmath.
template <typename scalar_t, typename opmath_t>
void add_bias_row_strided(
    scalar_t* row, int64_t stride, int64_t sk, opmath_t neg_slope, int64_t q_pos, bool symmetric) {
  for (int64_t j = 0; j < sk; ++j) {
    scalar_t& score = row[j * stride];
    score = static_cast<scalar_t>(static_cast<opmath_t>(score) + scalar_bias(neg_slope, q_pos, j, symmetric));
  }
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
  const int64_t batch = scores.dim() == 4 ? scores.size(0) : 1;
  const int64_t heads = scores.size(-3);
  const int64_t sq = scores.size(-2);
  const int64_t sk = scores.size(-1);
  if (scores.numel() == 0) {
    return;
  }

  const at::Tensor slopes_c = slopes.contiguous();
  const float* slope_data = slopes_c.data_ptr<float>();
  const int64_t stride_b = scores.dim() == 4 ? scores.stride(0) : 0;
  const int64_t stride_h = scores.stride(-3);
  const int64_t stride_q = scores.stride(-2);
  const int64_t stride_k = scores.stride(-1);
  const int64_t rows = batch * heads * sq;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(sk, 1));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "alibi_bias_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* base = scores.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t i = r % sq;
        const int64_t h = (r / sq) % heads;
        const int64_t b = r / (sq * heads);
        scalar_t* row = base + b * stride_b + h * stride_h + i * stride_q;
        const opmath_t neg_slope = -static_cast<opmath_t>(slope_data[h]);
        const int64_t q_pos = i + q_offset;
        if (stride_k != 1) {
          add_bias_row_strided<scalar_t, opmath_t>(row, stride_k, sk, neg_slope, q_pos, symmetric);
        } else if constexpr (std::is_same_v<scalar_t, opmath_t>) {
          add_bias_row<scalar_t>(row, sk, neg_slope, q_pos, symmetric);
        } else {
          add_bias_row_reduced<scalar_t>(row, sk, neg_slope, q_pos, symmetric);
        }
      }
    });
  });
}

// FakeTensor / torch.compile: nothing to compute, everything to check.
void alibi_bias_meta_(const at::Tensor& scores, const at::Tensor& slopes, int64_t q_offset, bool /*symmetric*/) {
  check_alibi_bias(scores, slopes, q_offset);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.alibi");
  m.def(
      "alibi_bias_(Tensor(a!) scores, Tensor slopes, int q_offset=0, bool symmetric=False) -> ()",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("alibi_bias_", &alibi_bias_cpu_);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("alibi_bias_", &alibi_bias_meta_);
}

}  // namespace ascendspeed
