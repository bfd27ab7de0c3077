// The in-place ALiBi CPU kernels, written once against at::vec::Vectorized and compiled once per
// instruction set. Only a kernels_<isa>.cpp includes this, inside its instruction-set region.
//
// One pass over the scores: each row is read, biased in opmath and written back once. The bias is
// computed in opmath (fp32; fp64 for double scores) whatever the score dtype: the distance is an exact
// integer and the bias is a single rounding of slope * distance, added to the score before the one
// rounding back to the score dtype.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

namespace ascendspeed::alibi {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Elements per parallel task: below this a second thread costs more to wake than it saves.
constexpr int64_t kGrainSize = 32768;

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

}  // namespace

void add_bias(const at::Tensor& scores, const float* slope_data, int64_t q_offset, bool symmetric) {
  const int64_t batch = scores.dim() == 4 ? scores.size(0) : 1;
  const int64_t heads = scores.size(-3);
  const int64_t sq = scores.size(-2);
  const int64_t sk = scores.size(-1);
  const int64_t stride_b = scores.dim() == 4 ? scores.stride(0) : 0;
  const int64_t stride_h = scores.stride(-3);
  const int64_t stride_q = scores.stride(-2);
  const int64_t stride_k = scores.stride(-1);
  const int64_t rows = batch * heads * sq;
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(sk, 1));

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

} // namespace CPU_CAPABILITY
} // namespace ascendspeed::alibi
