// The MoE permutation row kernels, written once against at::vec::Vectorized and compiled once per
// instruction set. Only a kernels_<isa>.cpp includes this, inside its instruction-set region.
//
// Numerics are megatron-core's unfused path to the bit (moe_permute.cpp says which): every element is
// computed on its own, so vectors change nothing but speed. Products with probs are taken in the compute
// type acc_t and rounded there; sums run in acc_t's opmath type, in row order from zero. Vectors hold the
// opmath type of the tokens; where it is not acc_t's (float tokens with double probs) the element loop runs.
#pragma once

#include "../common/vec_block.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>

namespace ascendspeed::moe_permute {
namespace CPU_CAPABILITY {
namespace {

using ascendspeed::vec::CPU_CAPABILITY::Block;

// Whether rows of scalar_t with products in acc_t run on Block<scalar_t>'s vectors: where both compute in
// one opmath type and a reduced acc_t is scalar_t itself (the promoted type of a reduced type and any other
// is float, so the operators never pair a reduced acc_t with another scalar_t).
template <typename scalar_t, typename acc_t>
constexpr bool kVectorized = std::is_same_v<at::opmath_type<scalar_t>, at::opmath_type<acc_t>> &&
    (!c10::is_reduced_floating_point_v<acc_t> || std::is_same_v<scalar_t, acc_t>);

// v (the opmath values of a block of scalar_t) rounded to acc_t and back, as an acc_t product is.
template <typename scalar_t, typename acc_t>
typename Block<scalar_t>::Values round_to_acc(const typename Block<scalar_t>::Values& v) {
  if constexpr (c10::is_reduced_floating_point_v<acc_t>) {
    auto [lo, hi] = at::vec::convert_to_float<acc_t>(at::vec::convert_from_float<acc_t>(v[0], v[1]));
    return {lo, hi};
  } else {
    return v;
  }
}

template <typename scalar_t, typename acc_t>
void gather_rows_typed(
    const scalar_t* x, const acc_t* probs, const RowsOfTokens& index, scalar_t* out, int64_t width) {
  using B = Block<scalar_t>;
  const int64_t num_tokens = static_cast<int64_t>(index.start.size()) - 1;
  // Token by token: each token's row is read once and written to each of its rows while it is in cache (a
  // row-order gather would read it once per expert).
  at::parallel_for(0, num_tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* src = x + t * width;
      for (int64_t i = index.start[t]; i < index.start[t + 1]; ++i) {
        const int64_t r = index.rows[i];
        scalar_t* dst = out + r * width;
        if (probs == nullptr) {
          std::memcpy(dst, src, sizeof(scalar_t) * width);
          continue;
        }
        const acc_t p = probs[r];
        int64_t h = 0;
        if constexpr (kVectorized<scalar_t, acc_t>) {
          const typename B::Vec pv(static_cast<at::opmath_type<acc_t>>(p));
          for (; h < width; h += B::kSize) {
            const int64_t n = std::min<int64_t>(B::kSize, width - h);
            auto v = B::load(src + h, n);
            for (auto& part : v) {
              part = part * pv;
            }
            // Rounded to acc_t, then to scalar_t: one rounding, as a reduced acc_t is scalar_t.
            B::store(dst + h, v, n);
          }
        }
        for (; h < width; ++h) {
          dst[h] = static_cast<scalar_t>(static_cast<acc_t>(src[h]) * p);
        }
      }
    }
  });
}

template <typename scalar_t, typename acc_t>
void scatter_add_rows_typed(
    const scalar_t* y, const acc_t* probs, const RowsOfTokens& index, scalar_t* out, int64_t width) {
  using sum_t = at::opmath_type<acc_t>;
  using B = Block<scalar_t>;
  const int64_t num_tokens = static_cast<int64_t>(index.start.size()) - 1;
  at::parallel_for(0, num_tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<sum_t> sum;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = index.start[t];
      const int64_t last = index.start[t + 1];
      scalar_t* dst = out + t * width;
      if constexpr (kVectorized<scalar_t, acc_t>) {
        // One block of the token at a time, summed over its rows in registers.
        for (int64_t h = 0; h < width; h += B::kSize) {
          const int64_t n = std::min<int64_t>(B::kSize, width - h);
          typename B::Values acc;
          acc.fill(typename B::Vec(sum_t(0)));
          for (int64_t i = first; i < last; ++i) {
            const int64_t r = index.rows[i];
            auto v = B::load(y + r * width + h, n);
            if (probs != nullptr) {
              const typename B::Vec pv(static_cast<sum_t>(probs[r]));
              for (auto& part : v) {
                part = part * pv;
              }
              v = round_to_acc<scalar_t, acc_t>(v);
            }
            for (size_t part = 0; part < acc.size(); ++part) {
              acc[part] = acc[part] + v[part];
            }
          }
          B::store(dst + h, acc, n);
        }
      } else {
        sum.assign(width, sum_t(0));
        for (int64_t i = first; i < last; ++i) {
          const int64_t r = index.rows[i];
          const scalar_t* src = y + r * width;
          for (int64_t h = 0; h < width; ++h) {
            const acc_t term = probs == nullptr ? static_cast<acc_t>(src[h]) : static_cast<acc_t>(src[h]) * probs[r];
            sum[h] = sum[h] + static_cast<sum_t>(term);
          }
        }
        for (int64_t h = 0; h < width; ++h) {
          dst[h] = static_cast<scalar_t>(static_cast<acc_t>(sum[h]));
        }
      }
    }
  });
}

// Rows of `rows` elements each; the dtype pair (rows, row_probs or rows) picks the typed kernel.
template <typename Kernel>
void dispatch_rows(const at::Tensor& rows, const at::Tensor& row_probs, const Kernel& kernel) {
  const auto acc = row_probs.defined() ? row_probs.scalar_type() : rows.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "moe_permute_rows", [&] {
    using rows_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc, "moe_permute_compute", [&] {
      kernel(rows_t{}, scalar_t{}, row_probs.defined() ? row_probs.const_data_ptr<scalar_t>() : nullptr);
    });
  });
}

void gather_rows(const at::Tensor& x, const at::Tensor& row_probs, const RowsOfTokens& index, const at::Tensor& out) {
  const int64_t width = out.numel() / out.size(0);
  dispatch_rows(x, row_probs, [&](auto x_type, auto acc_type, const auto* probs) {
    using x_t = decltype(x_type);
    using acc_t = decltype(acc_type);
    gather_rows_typed<x_t, acc_t>(x.const_data_ptr<x_t>(), probs, index, out.mutable_data_ptr<x_t>(), width);
  });
}

void scatter_add_rows(
    const at::Tensor& y, const at::Tensor& row_probs, const RowsOfTokens& index, const at::Tensor& out) {
  const int64_t width = out.numel() / out.size(0);
  dispatch_rows(y, row_probs, [&](auto y_type, auto acc_type, const auto* probs) {
    using y_t = decltype(y_type);
    using acc_t = decltype(acc_type);
    scatter_add_rows_typed<y_t, acc_t>(y.const_data_ptr<y_t>(), probs, index, out.mutable_data_ptr<y_t>(), width);
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace ascendspeed::moe_permute
