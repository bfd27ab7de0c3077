// The ALiBi flash attention CPU kernels, written once against at::vec::Vectorized and compiled once per
// instruction set. Only a kernels_<isa>.cpp includes this, inside its instruction-set region.
//
// Blockwise ("flash") attention with the ALiBi bias generated inside the softmax loop:
//   s[i, j] = scale * q_i . k_j - slope * (q_pos(i) - j),   q_pos(i) = i + q_offset,  keys j <= q_pos(i)
// Forward walks the key blocks of one query block with an online softmax (running row maximum and
// sum, the output rescaled when the maximum grows) and keeps only the output and each row's
// logsumexp. Backward recomputes every probability block from q, k and the logsumexp: nothing of
// size [sq, sk] is ever stored. Key blocks entirely after a query block's last position are
// skipped. Block matmuls run through block_gemm.h in opmath (fp32; fp64 for fp64 inputs): bf16 / fp16
// rows are widened to fp32 first, except bf16 on CPUs with bf16 dot products (see "bf16 dot products"
// below). Bias, softmax and every accumulator are in opmath.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "block_gemm.h"
#include "../common/flush_subnormals.h"

namespace ascendspeed::alibi_attention {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Query rows per block (the unit of parallel work in forward) and keys per block. A block of scores
// (128 x 256 fp32, 128 KiB) and its companions stay in L2; the diagonal blocks of a causal mask waste
// at most half a block row of work.
constexpr int64_t kBlockQ = 128;
constexpr int64_t kBlockK = 256;

// The exponential torch's own CPU flash attention uses for fp32 (a polynomial, about 2e-6 relative
// error); full precision for fp64.
template <typename acc_t>
inline Vectorized<acc_t> vec_exp(const Vectorized<acc_t>& x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// Converts n opmath values to scalar_t (a no-op copy avoided by the callers for fp32 / fp64).
template <typename scalar_t, typename acc_t>
void convert_row(const acc_t* src, scalar_t* dst, int64_t n) {
  at::vec::convert<acc_t, scalar_t>(src, dst, n);
}

// Scores of one row of a block: s[j] = scale * dot[j] - slope * (q_pos - (k_begin + j)) for the
// `visible` first keys (those not after q_pos); returns the row maximum.
template <typename acc_t>
acc_t biased_scores(acc_t* s, int64_t visible, acc_t scale, acc_t slope, int64_t first_distance) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  // key_minus_query = (k_begin + j) - q_pos, an exact integer in opmath (positions < 2^24).
  Vec key_minus_query = Vec::arange(static_cast<acc_t>(-first_distance), acc_t(1));
  const Vec step(static_cast<acc_t>(W));
  const Vec scale_vec(scale);
  const Vec slope_vec(slope);
  Vec max_vec(-std::numeric_limits<acc_t>::infinity());
  int64_t j = 0;
  for (; j + W <= visible; j += W) {
    const Vec biased = Vec::loadu(s + j) * scale_vec + slope_vec * key_minus_query;
    biased.store(s + j);
    max_vec = at::vec::maximum(max_vec, biased);
    key_minus_query = key_minus_query + step;
  }
  acc_t row_max = at::vec::vec_reduce_all<acc_t>(
      [](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); }, max_vec);
  for (; j < visible; ++j) {
    s[j] = s[j] * scale + slope * static_cast<acc_t>(j - first_distance);
    row_max = std::max(row_max, s[j]);
  }
  return row_max;
}

// p[j] = exp(s[j] - shift) for the visible keys, 0 for the rest of the block; returns the sum.
template <typename acc_t>
acc_t exp_shifted(acc_t* s, int64_t visible, int64_t block_keys, acc_t shift) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const Vec shift_vec(shift);
  Vec sum_vec(acc_t(0));
  int64_t j = 0;
  for (; j + W <= visible; j += W) {
    const Vec p = vec_exp(Vec::loadu(s + j) - shift_vec);
    p.store(s + j);
    sum_vec = sum_vec + p;
  }
  if (j < visible) {
    const Vec p = vec_exp(Vec::loadu(s + j, visible - j) - shift_vec);
    p.store(s + j, visible - j);
    sum_vec = sum_vec + Vec::set(Vec(acc_t(0)), p, visible - j);
  }
  std::fill(s + visible, s + block_keys, acc_t(0));
  return at::vec::vec_reduce_all<acc_t>([](const Vec& x, const Vec& y) { return x + y; }, sum_vec);
}

// Keys [0, key_end) can be seen by some row of the query block [q_begin, q_end).
inline int64_t key_end_of(int64_t q_end, int64_t q_offset, int64_t sk) {
  return std::min(sk, q_end - 1 + q_offset + 1);
}

// Keys of the block starting at k_begin that row i (position q_pos) sees.
inline int64_t visible_keys(int64_t q_pos, int64_t k_begin, int64_t block_keys) {
  return std::clamp<int64_t>(q_pos + 1 - k_begin, 0, block_keys);
}

// One row of a forward block: s holds the row's q.k products for the block's keys, `visible` of them
// seen. The row's running maximum, sum and output accumulator are updated (the accumulator rescaled
// when the maximum grows); exp_sum(visible, shift) writes exp(biased score - shift) for the visible keys
// (zeros for the rest) where the block's P V product reads them and returns their sum.
template <typename acc_t, typename ExpSum>
void online_softmax_row(acc_t* s, int64_t visible, acc_t scale, acc_t slope, int64_t first_distance, acc_t& row_max,
                        acc_t& row_sum, acc_t* acc_row, int64_t dim, const ExpSum& exp_sum) {
  if (visible == 0) {
    exp_sum(0, acc_t(0));
    return;
  }
  const acc_t block_max = biased_scores<acc_t>(s, visible, scale, slope, first_distance);
  const acc_t new_max = std::max(row_max, block_max);
  const acc_t block_sum = exp_sum(visible, new_max);
  // The first block of every row has a visible key, so row_max is finite from then on.
  const acc_t rescale = std::exp(row_max - new_max);
  row_sum = row_sum * rescale + block_sum;
  row_max = new_max;
  if (rescale != acc_t(1)) {
    at::vec::map([rescale](Vectorized<acc_t> x) { return x * Vectorized<acc_t>(rescale); }, acc_row, acc_row, dim);
  }
}

// The end of a forward query block: each output row divided by its sum and converted, and the logsumexp.
template <typename scalar_t, typename acc_t>
void finish_rows(acc_t* acc, int64_t rows, int64_t dim, const acc_t* row_max, const acc_t* row_sum,
                 scalar_t* out_block, int64_t out_stride, acc_t* lse_block) {
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t inverse = acc_t(1) / row_sum[r];
    at::vec::map([inverse](Vectorized<acc_t> x) { return x * Vectorized<acc_t>(inverse); },
                 acc + r * dim, acc + r * dim, dim);
    convert_row<scalar_t, acc_t>(acc + r * dim, out_block + r * out_stride, dim);
    lse_block[r] = row_max[r] + std::log(row_sum[r]);
  }
}

// One row of a backward block: p holds the row's q.k products, ds its dO.v products; p becomes the
// forward's probabilities exp(biased score - lse) and ds the score gradient p * (dp - delta).
template <typename acc_t>
void probabilities_and_score_grads_row(acc_t* p, acc_t* ds, int64_t cols, int64_t visible, acc_t scale, acc_t slope,
                                       int64_t first_distance, acc_t lse, acc_t delta) {
  using Vec = Vectorized<acc_t>;
  if (visible > 0) {
    biased_scores<acc_t>(p, visible, scale, slope, first_distance);
  }
  exp_shifted<acc_t>(p, visible, cols, lse);
  // dS = P * (dP - delta): zero where P is (the masked keys).
  const Vec delta_vec(delta);
  at::vec::map2([delta_vec](Vec pv, Vec dpv) { return pv * (dpv - delta_vec); }, ds, p, ds, cols);
}

// Rows of one operand as opmath values: read in place for fp32 / fp64, widened into a buffer for
// bf16 / fp16 so that every block matmul is an fp32 one with fp32 probabilities (MKL's bf16 gemm,
// for one, widens to fp32 itself on CPUs without native bf16 instructions, at every call).
template <typename scalar_t, typename acc_t>
struct WideRows {
  std::vector<acc_t> buffer;
  const acc_t* data = nullptr;
  int64_t ld = 0;

  void assign(const scalar_t* rows_data, int64_t row_stride, int64_t rows, int64_t dim) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      data = rows_data;
      ld = row_stride;
    } else {
      if (static_cast<int64_t>(buffer.size()) < rows * dim) {
        buffer.resize(rows * dim);
      }
      for (int64_t r = 0; r < rows; ++r) {
        at::vec::convert<scalar_t, acc_t>(rows_data + r * row_stride, buffer.data() + r * dim, dim);
      }
      data = buffer.data();
      ld = dim;
    }
  }
};

template <typename scalar_t>
void forward_typed(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& slopes,
    double scale_d,
    int64_t q_offset,
    const at::Tensor& out,
    const at::Tensor& lse) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = q.size(0), heads = q.size(1), sq = q.size(2), dim = q.size(3), sk = k.size(2);
  const acc_t scale = static_cast<acc_t>(scale_d);
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v.const_data_ptr<scalar_t>();
  const float* slope_data = slopes.const_data_ptr<float>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  acc_t* lse_data = lse.data_ptr<acc_t>();
  const int64_t head_key_end = key_end_of(sq, q_offset, sk);

  // One (batch, head) per task, its query blocks in order: a head's keys and values are widened once.
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    const ascendspeed::cpu::FlushSubnormals flush_subnormals;  // see ../common/flush_subnormals.h
    std::vector<acc_t> scores(kBlockQ * kBlockK);
    std::vector<acc_t> acc(kBlockQ * dim);
    std::vector<acc_t> row_max(kBlockQ), row_sum(kBlockQ);
    WideRows<scalar_t, acc_t> q_rows, k_rows, v_rows;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit % heads, b = unit / heads;
      k_rows.assign(k_data + b * k.stride(0) + h * k.stride(1), k.stride(2), head_key_end, dim);
      v_rows.assign(v_data + b * v.stride(0) + h * v.stride(1), v.stride(2), head_key_end, dim);
      const acc_t slope = static_cast<acc_t>(slope_data[h]);
      for (int64_t q_begin = 0; q_begin < sq; q_begin += kBlockQ) {
        const int64_t rows = std::min(kBlockQ, sq - q_begin);
        q_rows.assign(q_data + b * q.stride(0) + h * q.stride(1) + q_begin * q.stride(2), q.stride(2), rows, dim);
        std::fill(acc.begin(), acc.begin() + rows * dim, acc_t(0));
        std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<acc_t>::infinity());
        std::fill(row_sum.begin(), row_sum.end(), acc_t(0));
        const int64_t key_end = key_end_of(q_begin + rows, q_offset, sk);
        for (int64_t k_begin = 0; k_begin < key_end; k_begin += kBlockK) {
          const int64_t cols = std::min(kBlockK, key_end - k_begin);
          gemm_rows(false, true, rows, cols, dim, acc_t(1), q_rows.data, q_rows.ld, k_rows.data + k_begin * k_rows.ld,
                    k_rows.ld, acc_t(0), scores.data(), cols);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t q_pos = q_begin + r + q_offset;
            acc_t* s = scores.data() + r * cols;
            online_softmax_row<acc_t>(
                s, visible_keys(q_pos, k_begin, cols), scale, slope, q_pos - k_begin, row_max[r], row_sum[r],
                acc.data() + r * dim, dim,
                [s, cols](int64_t visible, acc_t shift) { return exp_shifted<acc_t>(s, visible, cols, shift); });
          }
          gemm_rows(false, false, rows, dim, cols, acc_t(1), scores.data(), cols, v_rows.data + k_begin * v_rows.ld,
                    v_rows.ld, acc_t(1), acc.data(), dim);
        }
        finish_rows<scalar_t, acc_t>(acc.data(), rows, dim, row_max.data(), row_sum.data(),
                                     out_data + b * out.stride(0) + h * out.stride(1) + q_begin * out.stride(2),
                                     out.stride(2), lse_data + (b * heads + h) * sq + q_begin);
      }
    }
  });
}

// delta[r] = sum_d grad_out[r, d] * out[r, d]: the softmax backward's row term.
template <typename scalar_t, typename acc_t>
void row_dots(const scalar_t* grad_out, int64_t go_stride, const scalar_t* out, int64_t out_stride,
              int64_t rows, int64_t dim, acc_t* delta) {
  for (int64_t r = 0; r < rows; ++r) {
    acc_t total = 0;
    const scalar_t* g = grad_out + r * go_stride;
    const scalar_t* o = out + r * out_stride;
    for (int64_t d = 0; d < dim; ++d) {
      total += static_cast<acc_t>(g[d]) * static_cast<acc_t>(o[d]);
    }
    delta[r] = total;
  }
}

template <typename scalar_t>
void backward_typed(
    const at::Tensor& grad_out,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& out,
    const at::Tensor& lse,
    const at::Tensor& slopes,
    double scale_d,
    int64_t q_offset,
    const at::Tensor& grad_q,
    const at::Tensor& grad_k,
    const at::Tensor& grad_v) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = q.size(0), heads = q.size(1), sq = q.size(2), dim = q.size(3), sk = k.size(2);
  const acc_t scale = static_cast<acc_t>(scale_d);
  const scalar_t* go_data = grad_out.const_data_ptr<scalar_t>();
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v.const_data_ptr<scalar_t>();
  const scalar_t* out_data = out.const_data_ptr<scalar_t>();
  const acc_t* lse_data = lse.const_data_ptr<acc_t>();
  const float* slope_data = slopes.const_data_ptr<float>();
  scalar_t* gq_data = grad_q.data_ptr<scalar_t>();
  scalar_t* gk_data = grad_k.data_ptr<scalar_t>();
  scalar_t* gv_data = grad_v.data_ptr<scalar_t>();
  const int64_t head_key_end = key_end_of(sq, q_offset, sk);

  // One (batch, head) per task: grad_k and grad_v of a head accumulate over all its query blocks.
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    const ascendspeed::cpu::FlushSubnormals flush_subnormals;  // see ../common/flush_subnormals.h
    std::vector<acc_t> probs(kBlockQ * kBlockK), grad_scores(kBlockQ * kBlockK);
    std::vector<acc_t> gq_acc(kBlockQ * dim), gk_acc(sk * dim), gv_acc(sk * dim), delta(kBlockQ);
    WideRows<scalar_t, acc_t> q_rows, go_rows, k_rows, v_rows;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit % heads, b = unit / heads;
      k_rows.assign(k_data + b * k.stride(0) + h * k.stride(1), k.stride(2), head_key_end, dim);
      v_rows.assign(v_data + b * v.stride(0) + h * v.stride(1), v.stride(2), head_key_end, dim);
      const scalar_t* q_head = q_data + b * q.stride(0) + h * q.stride(1);
      const scalar_t* go_head = go_data + b * grad_out.stride(0) + h * grad_out.stride(1);
      const scalar_t* out_head = out_data + b * out.stride(0) + h * out.stride(1);
      const acc_t* lse_head = lse_data + (b * heads + h) * sq;
      const acc_t slope = static_cast<acc_t>(slope_data[h]);
      std::fill(gk_acc.begin(), gk_acc.end(), acc_t(0));
      std::fill(gv_acc.begin(), gv_acc.end(), acc_t(0));
      for (int64_t q_begin = 0; q_begin < sq; q_begin += kBlockQ) {
        const int64_t rows = std::min(kBlockQ, sq - q_begin);
        q_rows.assign(q_head + q_begin * q.stride(2), q.stride(2), rows, dim);
        go_rows.assign(go_head + q_begin * grad_out.stride(2), grad_out.stride(2), rows, dim);
        row_dots<scalar_t, acc_t>(go_head + q_begin * grad_out.stride(2), grad_out.stride(2),
                                  out_head + q_begin * out.stride(2), out.stride(2), rows, dim, delta.data());
        std::fill(gq_acc.begin(), gq_acc.begin() + rows * dim, acc_t(0));
        const int64_t key_end = key_end_of(q_begin + rows, q_offset, sk);
        for (int64_t k_begin = 0; k_begin < key_end; k_begin += kBlockK) {
          const int64_t cols = std::min(kBlockK, key_end - k_begin);
          const acc_t* k_block = k_rows.data + k_begin * k_rows.ld;
          const acc_t* v_block = v_rows.data + k_begin * v_rows.ld;
          // P = exp(S + bias - lse), exactly forward's probabilities; dP = dO V^T.
          gemm_rows(false, true, rows, cols, dim, acc_t(1), q_rows.data, q_rows.ld, k_block, k_rows.ld, acc_t(0),
                    probs.data(), cols);
          gemm_rows(false, true, rows, cols, dim, acc_t(1), go_rows.data, go_rows.ld, v_block, v_rows.ld, acc_t(0),
                    grad_scores.data(), cols);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t q_pos = q_begin + r + q_offset;
            probabilities_and_score_grads_row<acc_t>(
                probs.data() + r * cols, grad_scores.data() + r * cols, cols, visible_keys(q_pos, k_begin, cols), scale,
                slope, q_pos - k_begin, lse_head[q_begin + r], delta[r]);
          }
          // dV += P^T dO;  dQ += scale * dS K;  dK += scale * dS^T Q
          gemm_rows(true, false, cols, dim, rows, acc_t(1), probs.data(), cols, go_rows.data, go_rows.ld, acc_t(1),
                    gv_acc.data() + k_begin * dim, dim);
          gemm_rows(false, false, rows, dim, cols, scale, grad_scores.data(), cols, k_block, k_rows.ld, acc_t(1),
                    gq_acc.data(), dim);
          gemm_rows(true, false, cols, dim, rows, scale, grad_scores.data(), cols, q_rows.data, q_rows.ld, acc_t(1),
                    gk_acc.data() + k_begin * dim, dim);
        }
        scalar_t* gq_block = gq_data + b * grad_q.stride(0) + h * grad_q.stride(1) + q_begin * grad_q.stride(2);
        for (int64_t r = 0; r < rows; ++r) {
          convert_row<scalar_t, acc_t>(gq_acc.data() + r * dim, gq_block + r * grad_q.stride(2), dim);
        }
      }
      scalar_t* gk_head = gk_data + b * grad_k.stride(0) + h * grad_k.stride(1);
      scalar_t* gv_head = gv_data + b * grad_v.stride(0) + h * grad_v.stride(1);
      for (int64_t j = 0; j < sk; ++j) {
        convert_row<scalar_t, acc_t>(gk_acc.data() + j * dim, gk_head + j * grad_k.stride(2), dim);
        convert_row<scalar_t, acc_t>(gv_acc.data() + j * dim, gv_head + j * grad_v.stride(2), dim);
      }
    }
  });
}

// ---- bf16 dot products -------------------------------------------------------------------------------
// bf16 inputs on CPUs that multiply bf16 natively (block_gemm.h: PackedBf16, bf16_dot_products()).
// q k^T and dO v^T take the bf16 rows as they are: a product of two bf16 is exact in fp32, so these
// scores equal the widened path's up to the order of the fp32 sums. An fp32 factor (probabilities,
// score gradients) enters as two bf16 terms, hi = bf16(x) and lo = bf16(x - hi), against the other
// operand taken twice: x is kept to about 2^-17 of itself where bf16 alone keeps 2^-9, so the
// probabilities are still never rounded to bf16. bf16 has fp32's exponent range, so the split is safe
// for any finite x (fp16 inputs keep the widened path).

inline int64_t round_up_even(int64_t n) {
  return n + (n & 1);
}

using FloatVec = Vectorized<float>;
using Bf16Vec = Vectorized<c10::BFloat16>;
constexpr int64_t kSplitWidth = Bf16Vec::size();  // two FloatVec

// x0, x1 rounded to bf16 (nearest even). With kNativeBf16, by AVX512-BF16's vcvtne2ps2bf16, one
// instruction for 32 values (the portable conversion takes about a dozen); it is written as inline
// assembly so that only this instruction, not the whole AVX-512 region, needs the extension, and runs
// only where the CPU has it (native_bf16_conversion()).
template <bool kNativeBf16>
inline Bf16Vec to_bf16(const FloatVec& x0, const FloatVec& x1) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kNativeBf16) {
    __m512i rounded;
    asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(rounded) : "v"(static_cast<__m512>(x1)), "v"(static_cast<__m512>(x0)));
    return Bf16Vec(rounded);
  }
#endif
  return at::vec::convert_from_float<c10::BFloat16>(x0, x1);
}

inline bool native_bf16_conversion() {
#if defined(CPU_CAPABILITY_AVX512)
  return cpu_has_avx512_bf16();
#else
  return false;
#endif
}

// The first n (<= kSplitWidth) values of the pair x0, x1 as hi = bf16(x) and lo = bf16(x - hi).
template <bool kNativeBf16>
inline void store_split(const FloatVec& x0, const FloatVec& x1, c10::BFloat16* hi, c10::BFloat16* lo, int64_t n) {
  const Bf16Vec high = to_bf16<kNativeBf16>(x0, x1);
  const auto [h0, h1] = at::vec::convert_to_float<c10::BFloat16>(high);
  const Bf16Vec low = to_bf16<kNativeBf16>(x0 - h0, x1 - h1);
  if (n == kSplitWidth) {
    high.store(hi);
    low.store(lo);
  } else {
    high.store(hi, n);
    low.store(lo, n);
  }
}

// Forward's exp_sum for bf16 products: p = exp(s - shift) for the visible keys, stored only as hi / lo
// (zeros up to `padded`); returns the fp32 sum of p.
template <bool kNativeBf16>
float exp_shifted_split(const float* s, int64_t visible, int64_t padded, float shift, c10::BFloat16* hi,
                        c10::BFloat16* lo) {
  constexpr int64_t W = FloatVec::size();
  const FloatVec shift_vec(shift), zero(0.0f);
  FloatVec sum_vec(0.0f);
  for (int64_t j = 0; j < visible; j += kSplitWidth) {
    const int64_t n = std::min(kSplitWidth, visible - j), n0 = std::min(W, n), n1 = n - n0;
    FloatVec p0 = vec_exp(FloatVec::loadu(s + j, n0) - shift_vec);
    FloatVec p1 = n1 > 0 ? vec_exp(FloatVec::loadu(s + j + W, n1) - shift_vec) : zero;
    if (n0 < W) {
      p0 = FloatVec::set(zero, p0, n0);
    }
    if (n1 < W) {
      p1 = FloatVec::set(zero, p1, n1);
    }
    sum_vec = sum_vec + p0 + p1;
    store_split<kNativeBf16>(p0, p1, hi + j, lo + j, n);
  }
  std::fill(hi + visible, hi + padded, c10::BFloat16(0.0f));
  std::fill(lo + visible, lo + padded, c10::BFloat16(0.0f));
  return at::vec::vec_reduce_all<float>([](const FloatVec& x, const FloatVec& y) { return x + y; }, sum_vec);
}

// Backward's row for bf16 products: from the row's q.k products p and dO.v products dp, the
// probabilities P = exp(biased score - lse) and score gradients dS = scale * P * (dP - delta), stored
// only as their hi / lo terms: P in (p_hi, p_lo) and dS in (ds_hi, ds_lo), each `cols` long, and dS again
// in the row of the left-hand operand [dS_hi | dS_lo] (`half` >= cols apart, zero-padded).
template <bool kNativeBf16>
void probabilities_and_score_grads_split(
    float* p, const float* dp, int64_t cols, int64_t visible, float scale, float slope, int64_t first_distance,
    float lse, float delta, c10::BFloat16* p_hi, c10::BFloat16* p_lo, c10::BFloat16* ds_hi, c10::BFloat16* ds_lo,
    c10::BFloat16* ds_left, int64_t half) {
  constexpr int64_t W = FloatVec::size();
  if (visible > 0) {
    biased_scores<float>(p, visible, scale, slope, first_distance);
  }
  const FloatVec lse_vec(lse), delta_vec(delta), scale_vec(scale), zero(0.0f);
  for (int64_t j = 0; j < visible; j += kSplitWidth) {
    const int64_t n = std::min(kSplitWidth, visible - j), n0 = std::min(W, n), n1 = n - n0;
    FloatVec p0 = vec_exp(FloatVec::loadu(p + j, n0) - lse_vec);
    FloatVec p1 = n1 > 0 ? vec_exp(FloatVec::loadu(p + j + W, n1) - lse_vec) : zero;
    if (n0 < W) {
      p0 = FloatVec::set(zero, p0, n0);
    }
    if (n1 < W) {
      p1 = FloatVec::set(zero, p1, n1);
    }
    const FloatVec ds0 = p0 * (FloatVec::loadu(dp + j, n0) - delta_vec) * scale_vec;
    const FloatVec ds1 = p1 * (FloatVec::loadu(dp + j + W, n1) - delta_vec) * scale_vec;
    store_split<kNativeBf16>(p0, p1, p_hi + j, p_lo + j, n);
    store_split<kNativeBf16>(ds0, ds1, ds_hi + j, ds_lo + j, n);
    std::copy(ds_hi + j, ds_hi + j + n, ds_left + j);
    std::copy(ds_lo + j, ds_lo + j + n, ds_left + half + j);
  }
  for (c10::BFloat16* row : {p_hi, p_lo, ds_hi, ds_lo}) {
    std::fill(row + visible, row + cols, c10::BFloat16(0.0f));
  }
  std::fill(ds_left + visible, ds_left + half, c10::BFloat16(0.0f));
  std::fill(ds_left + half + visible, ds_left + 2 * half, c10::BFloat16(0.0f));
}

// dst[r, 0:dim) = src row r (rows `stride` apart), dst[r, dim:ld) = 0, for r < rows.
inline void stage_rows(const c10::BFloat16* src, int64_t stride, int64_t rows, int64_t dim, c10::BFloat16* dst,
                       int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(src + r * stride, src + r * stride + dim, dst + r * ld);
    std::fill(dst + r * ld + dim, dst + (r + 1) * ld, c10::BFloat16(0.0f));
  }
}

// The right-hand operand [X; X] of a split product: rows [0, rows) of X twice, each copy padded with
// zero rows to `half` (even) rows. staging holds 2 * half * dim values.
inline void pack_twice(const c10::BFloat16* src, int64_t stride, int64_t rows, int64_t half, int64_t dim,
                       std::vector<c10::BFloat16>& staging, PackedBf16& packed) {
  for (int64_t copy = 0; copy < 2; ++copy) {
    stage_rows(src, stride, rows, dim, staging.data() + copy * half * dim, dim);
    std::fill(staging.data() + (copy * half + rows) * dim, staging.data() + (copy + 1) * half * dim,
              c10::BFloat16(0.0f));
  }
  packed.pack(staging.data(), dim, 2 * half, dim);
}

// The left-hand operand [X^T | X^T] of a split product whose right-hand side is [hi rows; lo rows]:
// dst[d, c * half + r] = X[r, d] for c in {0, 1}, zero for r in [rows, half).
inline void stage_transposed_twice(const c10::BFloat16* src, int64_t stride, int64_t rows, int64_t half,
                                   int64_t dim, c10::BFloat16* dst) {
  for (int64_t copy = 0; copy < 2; ++copy) {
    transpose_rows(src, stride, rows, dim, dst + copy * half, 2 * half);
    for (int64_t d = 0; d < dim; ++d) {
      std::fill(dst + d * 2 * half + copy * half + rows, dst + d * 2 * half + (copy + 1) * half, c10::BFloat16(0.0f));
    }
  }
}

template <bool kNativeBf16>
void forward_bf16_products(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& slopes,
    double scale_d,
    int64_t q_offset,
    const at::Tensor& out,
    const at::Tensor& lse) {
  using scalar_t = c10::BFloat16;
  const int64_t batch = q.size(0), heads = q.size(1), sq = q.size(2), dim = q.size(3), sk = k.size(2);
  const int64_t dim_even = round_up_even(dim);
  const float scale = static_cast<float>(scale_d);
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v.const_data_ptr<scalar_t>();
  const float* slope_data = slopes.const_data_ptr<float>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  float* lse_data = lse.data_ptr<float>();
  const int64_t head_key_end = key_end_of(sq, q_offset, sk);
  const int64_t key_blocks = (head_key_end + kBlockK - 1) / kBlockK;

  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    const ascendspeed::cpu::FlushSubnormals flush_subnormals;  // see ../common/flush_subnormals.h
    std::vector<float> scores(kBlockQ * kBlockK), acc(kBlockQ * dim), row_max(kBlockQ), row_sum(kBlockQ);
    std::vector<scalar_t> staging(2 * round_up_even(kBlockK) * dim);
    std::vector<scalar_t> q_block(kBlockQ * dim_even), p_split(kBlockQ * 2 * round_up_even(kBlockK));
    PackedBf16 keys_t;                                  // K^T of the head, [dim_even, head_key_end]
    std::vector<PackedBf16> values_twice(key_blocks);  // [V; V] of each key block
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit % heads, b = unit / heads;
      const scalar_t* k_head = k_data + b * k.stride(0) + h * k.stride(1);
      const scalar_t* v_head = v_data + b * v.stride(0) + h * v.stride(1);
      keys_t.pack_transposed(k_head, k.stride(2), head_key_end, dim);
      for (int64_t block = 0; block < key_blocks; ++block) {
        const int64_t k_begin = block * kBlockK, width = std::min(kBlockK, head_key_end - k_begin);
        pack_twice(v_head + k_begin * v.stride(2), v.stride(2), width, round_up_even(width), dim, staging,
                   values_twice[block]);
      }
      const float slope = slope_data[h];
      for (int64_t q_begin = 0; q_begin < sq; q_begin += kBlockQ) {
        const int64_t rows = std::min(kBlockQ, sq - q_begin);
        stage_rows(q_data + b * q.stride(0) + h * q.stride(1) + q_begin * q.stride(2), q.stride(2), rows, dim,
                   q_block.data(), dim_even);
        std::fill(acc.begin(), acc.begin() + rows * dim, 0.0f);
        std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
        std::fill(row_sum.begin(), row_sum.end(), 0.0f);
        const int64_t key_end = key_end_of(q_begin + rows, q_offset, sk);
        for (int64_t k_begin = 0; k_begin < key_end; k_begin += kBlockK) {
          const int64_t cols = std::min(kBlockK, key_end - k_begin);
          const PackedBf16& values = values_twice[k_begin / kBlockK];
          keys_t.multiply(q_block.data(), dim_even, rows, scores.data(), cols, false, k_begin, k_begin + cols);
          const int64_t half = values.k() / 2;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t q_pos = q_begin + r + q_offset;
            float* s = scores.data() + r * cols;
            scalar_t* hi = p_split.data() + r * 2 * half;
            online_softmax_row<float>(
                s, visible_keys(q_pos, k_begin, cols), scale, slope, q_pos - k_begin, row_max[r], row_sum[r],
                acc.data() + r * dim, dim, [s, half, hi](int64_t visible, float shift) {
                  return exp_shifted_split<kNativeBf16>(s, visible, half, shift, hi, hi + half);
                });
          }
          values.multiply(p_split.data(), 2 * half, rows, acc.data(), dim, true);
        }
        finish_rows<scalar_t, float>(acc.data(), rows, dim, row_max.data(), row_sum.data(),
                                     out_data + b * out.stride(0) + h * out.stride(1) + q_begin * out.stride(2),
                                     out.stride(2), lse_data + (b * heads + h) * sq + q_begin);
      }
    }
    release_bf16_dot_products();
  });
}

template <bool kNativeBf16>
void backward_bf16_products(
    const at::Tensor& grad_out,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& out,
    const at::Tensor& lse,
    const at::Tensor& slopes,
    double scale_d,
    int64_t q_offset,
    const at::Tensor& grad_q,
    const at::Tensor& grad_k,
    const at::Tensor& grad_v) {
  using scalar_t = c10::BFloat16;
  const int64_t batch = q.size(0), heads = q.size(1), sq = q.size(2), dim = q.size(3), sk = k.size(2);
  const int64_t dim_even = round_up_even(dim);
  const float scale = static_cast<float>(scale_d);
  const scalar_t* go_data = grad_out.const_data_ptr<scalar_t>();
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v.const_data_ptr<scalar_t>();
  const scalar_t* out_data = out.const_data_ptr<scalar_t>();
  const float* lse_data = lse.const_data_ptr<float>();
  const float* slope_data = slopes.const_data_ptr<float>();
  scalar_t* gq_data = grad_q.data_ptr<scalar_t>();
  scalar_t* gk_data = grad_k.data_ptr<scalar_t>();
  scalar_t* gv_data = grad_v.data_ptr<scalar_t>();
  const int64_t head_key_end = key_end_of(sq, q_offset, sk);
  const int64_t key_blocks = (head_key_end + kBlockK - 1) / kBlockK;
  const int64_t rows_half = round_up_even(kBlockQ), cols_half = round_up_even(kBlockK);

  // dQ += dS K per query block; dK^T += Q^T dS and dV^T += dO^T P accumulate over the head's query
  // blocks, transposed so that the split factor (dS, P) is the right-hand operand, packed once per block.
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    const ascendspeed::cpu::FlushSubnormals flush_subnormals;  // see ../common/flush_subnormals.h
    std::vector<float> probs(kBlockQ * kBlockK), grad_scores(kBlockQ * kBlockK);
    std::vector<float> gq_acc(kBlockQ * dim), gk_t(dim * sk), gv_t(dim * sk), delta(kBlockQ);
    std::vector<scalar_t> staging(2 * cols_half * dim);
    std::vector<scalar_t> q_block(kBlockQ * dim_even), go_block(kBlockQ * dim_even);
    std::vector<scalar_t> q_t_twice(dim * 2 * rows_half), go_t_twice(dim * 2 * rows_half);
    std::vector<scalar_t> split_left(kBlockQ * 2 * cols_half), split_right(2 * 2 * rows_half * kBlockK);
    PackedBf16 keys_t, values_t, factor;  // K^T, V^T of the head; one block's split P or dS
    std::vector<PackedBf16> keys_twice(key_blocks);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit % heads, b = unit / heads;
      const scalar_t* k_head = k_data + b * k.stride(0) + h * k.stride(1);
      const scalar_t* v_head = v_data + b * v.stride(0) + h * v.stride(1);
      const scalar_t* q_head = q_data + b * q.stride(0) + h * q.stride(1);
      const scalar_t* go_head = go_data + b * grad_out.stride(0) + h * grad_out.stride(1);
      const scalar_t* out_head = out_data + b * out.stride(0) + h * out.stride(1);
      const float* lse_head = lse_data + (b * heads + h) * sq;
      const float slope = slope_data[h];
      keys_t.pack_transposed(k_head, k.stride(2), head_key_end, dim);
      values_t.pack_transposed(v_head, v.stride(2), head_key_end, dim);
      for (int64_t block = 0; block < key_blocks; ++block) {
        const int64_t k_begin = block * kBlockK, width = std::min(kBlockK, head_key_end - k_begin);
        pack_twice(k_head + k_begin * k.stride(2), k.stride(2), width, round_up_even(width), dim, staging,
                   keys_twice[block]);
      }
      std::fill(gk_t.begin(), gk_t.end(), 0.0f);
      std::fill(gv_t.begin(), gv_t.end(), 0.0f);
      for (int64_t q_begin = 0; q_begin < sq; q_begin += kBlockQ) {
        const int64_t rows = std::min(kBlockQ, sq - q_begin), half_rows = round_up_even(rows);
        const scalar_t* q_rows = q_head + q_begin * q.stride(2);
        const scalar_t* go_rows = go_head + q_begin * grad_out.stride(2);
        stage_rows(q_rows, q.stride(2), rows, dim, q_block.data(), dim_even);
        stage_rows(go_rows, grad_out.stride(2), rows, dim, go_block.data(), dim_even);
        stage_transposed_twice(q_rows, q.stride(2), rows, half_rows, dim, q_t_twice.data());
        stage_transposed_twice(go_rows, grad_out.stride(2), rows, half_rows, dim, go_t_twice.data());
        row_dots<scalar_t, float>(go_rows, grad_out.stride(2), out_head + q_begin * out.stride(2), out.stride(2), rows,
                                  dim, delta.data());
        std::fill(gq_acc.begin(), gq_acc.begin() + rows * dim, 0.0f);
        const int64_t key_end = key_end_of(q_begin + rows, q_offset, sk);
        for (int64_t k_begin = 0; k_begin < key_end; k_begin += kBlockK) {
          const int64_t cols = std::min(kBlockK, key_end - k_begin);
          keys_t.multiply(q_block.data(), dim_even, rows, probs.data(), cols, false, k_begin, k_begin + cols);
          values_t.multiply(go_block.data(), dim_even, rows, grad_scores.data(), cols, false, k_begin, k_begin + cols);
          const PackedBf16& keys = keys_twice[k_begin / kBlockK];
          const int64_t half_cols = keys.k() / 2;
          scalar_t* p_split = split_right.data();  // [P_hi; P_lo], [2 * half_rows, cols]
          scalar_t* ds_split = p_split + 2 * half_rows * cols;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t q_pos = q_begin + r + q_offset;
            probabilities_and_score_grads_split<kNativeBf16>(
                probs.data() + r * cols, grad_scores.data() + r * cols, cols, visible_keys(q_pos, k_begin, cols),
                scale, slope, q_pos - k_begin, lse_head[q_begin + r], delta[r], p_split + r * cols,
                p_split + (half_rows + r) * cols, ds_split + r * cols, ds_split + (half_rows + r) * cols,
                split_left.data() + r * 2 * half_cols, half_cols);
          }
          if (rows < half_rows) {  // the zero row of an odd block
            for (scalar_t* split : {p_split, ds_split}) {
              std::fill(split + rows * cols, split + half_rows * cols, scalar_t(0.0f));
              std::fill(split + (half_rows + rows) * cols, split + 2 * half_rows * cols, scalar_t(0.0f));
            }
          }
          // dV^T += [dO^T | dO^T] [P_hi; P_lo];  dK^T += [Q^T | Q^T] [dS_hi; dS_lo] (dS carries the scale)
          factor.pack(p_split, cols, 2 * half_rows, cols);
          factor.multiply(go_t_twice.data(), 2 * half_rows, dim, gv_t.data() + k_begin, sk, true);
          factor.pack(ds_split, cols, 2 * half_rows, cols);
          factor.multiply(q_t_twice.data(), 2 * half_rows, dim, gk_t.data() + k_begin, sk, true);
          // dQ += [dS_hi | dS_lo] [K; K]
          keys.multiply(split_left.data(), 2 * half_cols, rows, gq_acc.data(), dim, true);
        }
        scalar_t* gq_block = gq_data + b * grad_q.stride(0) + h * grad_q.stride(1) + q_begin * grad_q.stride(2);
        for (int64_t r = 0; r < rows; ++r) {
          convert_row<scalar_t, float>(gq_acc.data() + r * dim, gq_block + r * grad_q.stride(2), dim);
        }
      }
      scalar_t* gk_head = gk_data + b * grad_k.stride(0) + h * grad_k.stride(1);
      scalar_t* gv_head = gv_data + b * grad_v.stride(0) + h * grad_v.stride(1);
      transpose_rows(gk_t.data(), sk, dim, sk, gk_head, grad_k.stride(2));
      transpose_rows(gv_t.data(), sk, dim, sk, gv_head, grad_v.stride(2));
    }
    release_bf16_dot_products();
  });
}

void forward(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset,
    const at::Tensor& out,
    const at::Tensor& lse) {
  if (q.scalar_type() == at::kBFloat16 && bf16_dot_products()) {
    if (native_bf16_conversion()) {
      forward_bf16_products<true>(q, k, v, slopes, scale, q_offset, out, lse);
    } else {
      forward_bf16_products<false>(q, k, v, slopes, scale, q_offset, out, lse);
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "alibi_flash_attention", [&] {
    forward_typed<scalar_t>(q, k, v, slopes, scale, q_offset, out, lse);
  });
}

void backward(
    const at::Tensor& grad_out,
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& out,
    const at::Tensor& lse,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset,
    const at::Tensor& grad_q,
    const at::Tensor& grad_k,
    const at::Tensor& grad_v) {
  if (q.scalar_type() == at::kBFloat16 && bf16_dot_products()) {
    if (native_bf16_conversion()) {
      backward_bf16_products<true>(grad_out, q, k, v, out, lse, slopes, scale, q_offset, grad_q, grad_k, grad_v);
    } else {
      backward_bf16_products<false>(grad_out, q, k, v, out, lse, slopes, scale, q_offset, grad_q, grad_k, grad_v);
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "alibi_flash_attention_backward", [&] {
    backward_typed<scalar_t>(grad_out, q, k, v, out, lse, slopes, scale, q_offset, grad_q, grad_k, grad_v);
  });
}

} // namespace
} // namespace CPU_CAPABILITY
} // namespace ascendspeed::alibi_attention
