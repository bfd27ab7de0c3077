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
// rows are widened to fp32 first. Bias, softmax and every accumulator are in opmath as well.
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
            const int64_t visible = visible_keys(q_pos, k_begin, cols);
            acc_t* s = scores.data() + r * cols;
            if (visible == 0) {
              std::fill(s, s + cols, acc_t(0));
              continue;
            }
            const acc_t block_max = biased_scores<acc_t>(s, visible, scale, slope, q_pos - k_begin);
            const acc_t new_max = std::max(row_max[r], block_max);
            const acc_t block_sum = exp_shifted<acc_t>(s, visible, cols, new_max);
            // The first block of every row has a visible key, so row_max is finite from then on.
            const acc_t rescale = std::exp(row_max[r] - new_max);
            row_sum[r] = row_sum[r] * rescale + block_sum;
            row_max[r] = new_max;
            if (rescale != acc_t(1)) {
              at::vec::map([rescale](Vectorized<acc_t> x) { return x * Vectorized<acc_t>(rescale); },
                           acc.data() + r * dim, acc.data() + r * dim, dim);
            }
          }
          gemm_rows(false, false, rows, dim, cols, acc_t(1), scores.data(), cols, v_rows.data + k_begin * v_rows.ld,
                    v_rows.ld, acc_t(1), acc.data(), dim);
        }
        scalar_t* out_block = out_data + b * out.stride(0) + h * out.stride(1) + q_begin * out.stride(2);
        acc_t* lse_block = lse_data + (b * heads + h) * sq + q_begin;
        for (int64_t r = 0; r < rows; ++r) {
          const acc_t inverse = acc_t(1) / row_sum[r];
          at::vec::map([inverse](Vectorized<acc_t> x) { return x * Vectorized<acc_t>(inverse); },
                       acc.data() + r * dim, acc.data() + r * dim, dim);
          convert_row<scalar_t, acc_t>(acc.data() + r * dim, out_block + r * out.stride(2), dim);
          lse_block[r] = row_max[r] + std::log(row_sum[r]);
        }
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
  using Vec = Vectorized<acc_t>;
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
            const int64_t visible = visible_keys(q_pos, k_begin, cols);
            acc_t* p = probs.data() + r * cols;
            acc_t* ds = grad_scores.data() + r * cols;
            if (visible > 0) {
              biased_scores<acc_t>(p, visible, scale, slope, q_pos - k_begin);
            }
            exp_shifted<acc_t>(p, visible, cols, lse_head[q_begin + r]);
            // dS = P * (dP - delta): zero where P is (the masked keys).
            const Vec delta_vec(delta[r]);
            at::vec::map2([delta_vec](Vec pv, Vec dpv) { return pv * (dpv - delta_vec); }, ds, p, ds, cols);
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

void forward(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& slopes,
    double scale,
    int64_t q_offset,
    const at::Tensor& out,
    const at::Tensor& lse) {
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "alibi_flash_attention_backward", [&] {
    backward_typed<scalar_t>(grad_out, q, k, v, out, lse, slopes, scale, q_offset, grad_q, grad_k, grad_v);
  });
}

} // namespace
} // namespace CPU_CAPABILITY
} // namespace ascendspeed::alibi_attention
