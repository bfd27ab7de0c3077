// The RMSNorm CPU kernels, written once against at::vec::Vectorized and compiled once per instruction
// set. Only a kernels_<isa>.cpp includes this, inside its instruction-set region.
//
// Each row is streamed from memory once: forward reads x and writes y; backward reads grad_y and x
// and writes grad_x. The second pass over a row (forward: scaling; backward: the gradients) reads it
// back from cache. Math is done in opmath_t: float for float/bfloat16/half, double for double.
#pragma once

#include "../common/vec_block.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <vector>

namespace ascendspeed::rms_norm {
namespace CPU_CAPABILITY {
namespace {

using ascendspeed::vec::CPU_CAPABILITY::Block;

// Below this many elements a second thread costs more to wake than it saves.
constexpr int64_t kGrainSize = 32768;

// sum(a[i] * b[i]) over a row in opmath, with two independent accumulators per vector part (shorter
// dependency chains, and fewer terms summed in sequence per lane: better accuracy).
template <typename scalar_t, typename LoadB>
at::opmath_type<scalar_t> row_dot(const scalar_t* a, const LoadB& load_b, int64_t cols) {
  using B = Block<scalar_t>;
  using Vec = typename B::Vec;
  typename B::Values even, odd;
  even.fill(Vec(0));
  odd.fill(Vec(0));
  int64_t i = 0;
  for (; i + 2 * B::kSize <= cols; i += 2 * B::kSize) {
    const auto a0 = B::load(a + i);
    const auto b0 = load_b(i, B::kSize);
    const auto a1 = B::load(a + i + B::kSize);
    const auto b1 = load_b(i + B::kSize, B::kSize);
    for (int p = 0; p < B::kParts; ++p) {
      even[p] = at::vec::fmadd(a0[p], b0[p], even[p]);
      odd[p] = at::vec::fmadd(a1[p], b1[p], odd[p]);
    }
  }
  for (; i < cols; i += B::kSize) {
    const int64_t count = std::min(B::kSize, cols - i);
    const auto a0 = B::load(a + i, count);
    const auto b0 = load_b(i, count);
    for (int p = 0; p < B::kParts; ++p) {
      even[p] = at::vec::fmadd(a0[p], b0[p], even[p]);
    }
  }
  Vec total = even[0] + odd[0];
  for (int p = 1; p < B::kParts; ++p) {
    total = total + even[p] + odd[p];
  }
  return at::vec::vec_reduce_all<typename B::opmath_t>(std::plus<Vec>(), total);
}

template <typename scalar_t>
void forward_typed(
    const at::Tensor& x,
    const at::Tensor& gamma,
    double eps,
    const at::Tensor& y,
    const at::Tensor& rstd,
    int64_t rows,
    int64_t cols) {
  using B = Block<scalar_t>;
  using opmath_t = typename B::opmath_t;
  using Vec = typename B::Vec;
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  const opmath_t* gamma_data = gamma.const_data_ptr<opmath_t>();
  scalar_t* y_data = y.mutable_data_ptr<scalar_t>();
  opmath_t* rstd_data = rstd.mutable_data_ptr<opmath_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainSize / cols);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* xr = x_data + row * cols;
      scalar_t* yr = y_data + row * cols;
      const auto squares = row_dot(xr, [&](int64_t i, int64_t count) { return B::load(xr + i, count); }, cols);
      const opmath_t r = opmath_t(1) / std::sqrt(squares / opmath_t(cols) + static_cast<opmath_t>(eps));
      rstd_data[row] = r;
      const Vec vr(r);
      const bool prefetch_next = row + 1 < end;
      for (int64_t i = 0; i < cols; i += B::kSize) {
        const int64_t count = std::min(B::kSize, cols - i);
        if (prefetch_next) {
          __builtin_prefetch(xr + cols + i);
        }
        auto v = B::load(xr + i, count);
        const auto g = B::load_opmath(gamma_data + i, count);
        for (int p = 0; p < B::kParts; ++p) {
          v[p] = v[p] * vr * g[p];
        }
        B::store(yr + i, v, count);
      }
    }
  });
}

// Rows are taken kRowBlock at a time in the second backward pass: the weight and the partial weight
// gradient (a row of opmath values each, twice the bytes of a bf16 row) are then loaded and stored
// once per block of rows instead of once per row.
constexpr int kRowBlock = 4;

// The operands of the backward, as row-major arrays of `cols` columns.
template <typename scalar_t>
struct BackwardOperands {
  const scalar_t* grad_y;
  const scalar_t* x;
  const at::opmath_type<scalar_t>* rstd;
  const at::opmath_type<scalar_t>* gamma;
  scalar_t* grad_x;
  int64_t cols;
};

// Rows [first, first + kRows) of one thread: grad_x, and grad_gamma summed into `partial`.
template <int kRows, typename scalar_t>
void backward_row_block(
    const BackwardOperands<scalar_t>& in,
    at::opmath_type<scalar_t>* partial,
    int64_t first,
    bool prefetch_next) {
  using B = Block<scalar_t>;
  using opmath_t = typename B::opmath_t;
  using Vec = typename B::Vec;
  const int64_t cols = in.cols;
  std::array<const scalar_t*, kRows> gr, xr;
  std::array<scalar_t*, kRows> dxr;
  std::array<Vec, kRows> vr, correction;
  for (int k = 0; k < kRows; ++k) {
    gr[k] = in.grad_y + (first + k) * cols;
    xr[k] = in.x + (first + k) * cols;
    dxr[k] = in.grad_x + (first + k) * cols;
    const opmath_t r = in.rstd[first + k];
    // mean(grad_y * gamma * x)
    const opmath_t dot = row_dot(
        xr[k],
        [&](int64_t i, int64_t count) {
          auto g = B::load(gr[k] + i, count);
          const auto w = B::load_opmath(in.gamma + i, count);
          for (int p = 0; p < B::kParts; ++p) {
            g[p] = g[p] * w[p];
          }
          return g;
        },
        cols);
    vr[k] = Vec(r);
    // r^3 * mean: in this order r^3 alone cannot underflow where the product does not.
    correction[k] = Vec(r * (r * (r * dot / opmath_t(cols))));
  }
  for (int64_t i = 0; i < cols; i += B::kSize) {
    const int64_t count = std::min(B::kSize, cols - i);
    const auto w = B::load_opmath(in.gamma + i, count);
    auto dw = B::load_opmath(partial + i, count);
    for (int k = 0; k < kRows; ++k) {
      if (prefetch_next) {
        __builtin_prefetch(gr[k] + kRows * cols + i);
        __builtin_prefetch(xr[k] + kRows * cols + i);
      }
      const auto g = B::load(gr[k] + i, count);
      const auto x = B::load(xr[k] + i, count);
      typename B::Values dx;
      for (int p = 0; p < B::kParts; ++p) {
        const Vec scaled = g[p] * vr[k];
        dx[p] = at::vec::fmsub(scaled, w[p], x[p] * correction[k]);
        dw[p] = at::vec::fmadd(scaled, x[p], dw[p]);
      }
      B::store(dxr[k] + i, dx, count);
    }
    B::store_opmath(partial + i, dw, count);
  }
}

// One thread's rows [begin, end): grad_x, and grad_gamma summed into `partial` (cols opmath values).
template <typename scalar_t>
void backward_rows(
    const BackwardOperands<scalar_t>& in,
    at::opmath_type<scalar_t>* partial,
    int64_t begin,
    int64_t end) {
  int64_t row = begin;
  for (; row + kRowBlock <= end; row += kRowBlock) {
    backward_row_block<kRowBlock>(in, partial, row, row + 2 * kRowBlock <= end);
  }
  for (; row < end; ++row) {
    backward_row_block<1>(in, partial, row, false);
  }
}

template <typename scalar_t>
void backward_typed(
    const at::Tensor& grad_y,
    const at::Tensor& x,
    const at::Tensor& rstd,
    const at::Tensor& gamma,
    const at::Tensor& grad_x,
    const at::Tensor& grad_gamma,
    int64_t rows,
    int64_t cols) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<opmath_t>;
  // One partial grad_gamma row per thread (as many as are worth waking), summed at the end.
  const int64_t chunks = std::clamp<int64_t>(
      rows * cols / kGrainSize, 1, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows)));
  opmath_t* out = grad_gamma.mutable_data_ptr<opmath_t>();
  std::vector<opmath_t> partials(chunks == 1 ? 0 : chunks * cols, opmath_t(0));
  std::fill(out, out + cols, opmath_t(0));
  opmath_t* partial_data = chunks == 1 ? out : partials.data();
  const BackwardOperands<scalar_t> in{
      grad_y.const_data_ptr<scalar_t>(),
      x.const_data_ptr<scalar_t>(),
      rstd.const_data_ptr<opmath_t>(),
      gamma.const_data_ptr<opmath_t>(),
      grad_x.mutable_data_ptr<scalar_t>(),
      cols};
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t chunk = first; chunk < last; ++chunk) {
      backward_rows(in, partial_data + chunk * cols, rows * chunk / chunks, rows * (chunk + 1) / chunks);
    }
  });
  if (chunks > 1) {
    for (int64_t i = 0; i < cols; i += Vec::size()) {
      const int64_t count = std::min<int64_t>(Vec::size(), cols - i);
      Vec sum = Vec::loadu(partial_data + i, count);
      for (int64_t chunk = 1; chunk < chunks; ++chunk) {
        sum = sum + Vec::loadu(partial_data + chunk * cols + i, count);
      }
      sum.store(out + i, count);
    }
  }
}

} // namespace

void forward(
    const at::Tensor& x,
    const at::Tensor& gamma,
    double eps,
    const at::Tensor& y,
    const at::Tensor& rstd,
    int64_t rows,
    int64_t cols) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
    forward_typed<scalar_t>(x, gamma, eps, y, rstd, rows, cols);
  });
}

void backward(
    const at::Tensor& grad_y,
    const at::Tensor& x,
    const at::Tensor& rstd,
    const at::Tensor& gamma,
    const at::Tensor& grad_x,
    const at::Tensor& grad_gamma,
    int64_t rows,
    int64_t cols) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_backward_cpu", [&] {
    backward_typed<scalar_t>(grad_y, x, rstd, gamma, grad_x, grad_gamma, rows, cols);
  });
}

} // namespace CPU_CAPABILITY
} // namespace ascendspeed::rms_norm
