// The SwiGLU CPU kernels, written once against at::vec::Vectorized and compiled once per instruction
// set. Only a kernels_<isa>.cpp includes this, inside its instruction-set region: everything here is
// then built for that instruction set.
//
// The kernels stream over memory once: forward reads x and writes y (3 elements moved per output
// element), backward reads grad_y and x and writes grad_x (5). Math is done in opmath_type:
// float for float/bfloat16/half, double for double.
#pragma once

#include "../common/vec_block.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <type_traits>

namespace ascendspeed::swiglu {
namespace CPU_CAPABILITY {
namespace {

using ascendspeed::vec::CPU_CAPABILITY::Block;
using ascendspeed::vec::CPU_CAPABILITY::sigmoid;
using at::vec::Vectorized;

// y = silu(a) * b * scale: scale is 1 for the plain operator (an exact multiply) and the row's routing
// probability for the weighted one, folded into the same pass.
template <typename scalar_t>
void forward_span(
    const scalar_t* a,
    const scalar_t* b,
    scalar_t* y,
    int64_t n,
    at::opmath_type<scalar_t> scale = 1) {
  using B = Block<scalar_t>;
  using Vec = typename B::Vec;
  const Vec vscale(scale);
  for (int64_t i = 0; i < n; i += B::kSize) {
    const int64_t count = std::min(B::kSize, n - i);
    const auto va = B::load(a + i, count);
    const auto vb = B::load(b + i, count);
    typename B::Values vy;
    for (int p = 0; p < B::kParts; ++p) {
      vy[p] = va[p] * sigmoid(va[p]) * vb[p] * vscale;
    }
    B::store(y + i, vy, count);
  }
}

// d/da silu(a) = s + silu(a) * (1 - s), the same as s * (1 + a * (1 - s)) with one multiply less.
template <typename scalar_t>
void backward_span(
    const scalar_t* g,
    const scalar_t* a,
    const scalar_t* b,
    scalar_t* da,
    scalar_t* db,
    int64_t n) {
  using B = Block<scalar_t>;
  using Vec = typename B::Vec;
  const Vec one(1);
  for (int64_t i = 0; i < n; i += B::kSize) {
    const int64_t count = std::min(B::kSize, n - i);
    const auto vg = B::load(g + i, count);
    const auto va = B::load(a + i, count);
    const auto vb = B::load(b + i, count);
    typename B::Values vda, vdb;
    for (int p = 0; p < B::kParts; ++p) {
      const Vec s = sigmoid(va[p]);
      const Vec silu = va[p] * s;
      vda[p] = vg[p] * vb[p] * (s + silu * (one - s));
      vdb[p] = vg[p] * silu;
    }
    B::store(da + i, vda, count);
    B::store(db + i, vdb, count);
  }
}

// The weighted backward (an expert's SwiGLU scaled by its tokens' routing probabilities, w one value per
// row) folds the scale into the same pass: the unweighted gradient of grad_y * w and, from the same loads,
// grad_w = sum of grad_y * silu(a) * b.
// Returns this span's sum of grad_y * silu(a) * b. A partial block loads its missing elements as 0,
// which add 0 to the sum.
template <typename scalar_t>
at::opmath_type<scalar_t> weighted_backward_span(
    const scalar_t* g,
    const scalar_t* a,
    const scalar_t* b,
    scalar_t* da,
    scalar_t* db,
    int64_t n,
    at::opmath_type<scalar_t> w) {
  using B = Block<scalar_t>;
  using Vec = typename B::Vec;
  const Vec one(1);
  const Vec vw(w);
  Vec sum(0);
  for (int64_t i = 0; i < n; i += B::kSize) {
    const int64_t count = std::min(B::kSize, n - i);
    const auto vg = B::load(g + i, count);
    const auto va = B::load(a + i, count);
    const auto vb = B::load(b + i, count);
    typename B::Values vda, vdb;
    for (int p = 0; p < B::kParts; ++p) {
      const Vec s = sigmoid(va[p]);
      const Vec silu = va[p] * s;
      const Vec g_silu = vg[p] * silu;
      const Vec gw = vg[p] * vw;
      vda[p] = gw * vb[p] * (s + silu * (one - s));
      vdb[p] = g_silu * vw;
      sum = at::vec::fmadd(g_silu, vb[p], sum);
    }
    B::store(da + i, vda, count);
    B::store(db + i, vdb, count);
  }
  return at::vec::vec_reduce_all([](Vec& x, Vec& y) { return x + y; }, sum);
}

// Below this many outputs a second thread costs more to wake than it saves (ATen's own grain for
// elementwise kernels).
constexpr int64_t kGrainSize = 32768;

// Splits the [rows, len] output index space between threads; each thread walks its range as
// pieces that never cross a row, so every piece is a contiguous run in x, y and the gradients.
template <typename F>
void parallel_pieces(int64_t rows, int64_t len, const F& piece) {
  at::parallel_for(0, rows * len, kGrainSize, [&](int64_t begin, int64_t end) {
    int64_t row = begin / len;
    int64_t col = begin % len;
    while (begin < end) {
      const int64_t n = std::min(len - col, end - begin);
      piece(row, col, n);
      begin += n;
      ++row;
      col = 0;
    }
  });
}

template <typename scalar_t>
void forward_typed(const at::Tensor& x, const at::Tensor& y, int64_t rows, int64_t len) {
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  scalar_t* y_data = y.mutable_data_ptr<scalar_t>();
  parallel_pieces(rows, len, [&](int64_t row, int64_t col, int64_t n) {
    const scalar_t* a = x_data + 2 * row * len + col;
    forward_span(a, a + len, y_data + row * len + col, n);
  });
}

template <typename scalar_t>
void backward_typed(
    const at::Tensor& grad_y,
    const at::Tensor& x,
    const at::Tensor& grad_x,
    int64_t rows,
    int64_t len) {
  const scalar_t* g_data = grad_y.const_data_ptr<scalar_t>();
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  scalar_t* dx_data = grad_x.mutable_data_ptr<scalar_t>();
  parallel_pieces(rows, len, [&](int64_t row, int64_t col, int64_t n) {
    const int64_t offset = 2 * row * len + col;
    const scalar_t* a = x_data + offset;
    scalar_t* da = dx_data + offset;
    backward_span(g_data + row * len + col, a, a + len, da, da + len, n);
  });
}

// Rows are divided between threads whole, so each row's gradient of w is one thread's sum.
template <typename F>
void parallel_rows(int64_t rows, int64_t len, const F& row_range) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(len, 1)), row_range);
}

template <typename scalar_t>
void weighted_forward_typed(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& y, int64_t rows, int64_t len) {
  using opmath_t = at::opmath_type<scalar_t>;
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  const opmath_t* w_data = w.const_data_ptr<opmath_t>();
  scalar_t* y_data = y.mutable_data_ptr<scalar_t>();
  parallel_rows(rows, len, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* a = x_data + 2 * row * len;
      forward_span(a, a + len, y_data + row * len, len, w_data[row]);
    }
  });
}

template <typename scalar_t>
void weighted_backward_typed(
    const at::Tensor& grad_y,
    const at::Tensor& x,
    const at::Tensor& w,
    const at::Tensor& grad_x,
    const at::Tensor& grad_w,
    int64_t rows,
    int64_t len) {
  using opmath_t = at::opmath_type<scalar_t>;
  const scalar_t* g_data = grad_y.const_data_ptr<scalar_t>();
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  const opmath_t* w_data = w.const_data_ptr<opmath_t>();
  scalar_t* dx_data = grad_x.mutable_data_ptr<scalar_t>();
  opmath_t* dw_data = grad_w.mutable_data_ptr<opmath_t>();
  parallel_rows(rows, len, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = 2 * row * len;
      const scalar_t* a = x_data + offset;
      scalar_t* da = dx_data + offset;
      dw_data[row] =
          weighted_backward_span(g_data + row * len, a, a + len, da, da + len, len, w_data[row]);
    }
  });
}

} // namespace

void forward(const at::Tensor& x, const at::Tensor& y, int64_t rows, int64_t len) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "swiglu_cpu", [&] {
    forward_typed<scalar_t>(x, y, rows, len);
  });
}

void backward(
    const at::Tensor& grad_y,
    const at::Tensor& x,
    const at::Tensor& grad_x,
    int64_t rows,
    int64_t len) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "swiglu_backward_cpu", [&] {
        backward_typed<scalar_t>(grad_y, x, grad_x, rows, len);
      });
}

void weighted_forward(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& y, int64_t rows, int64_t len) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "weighted_swiglu_cpu", [&] {
        weighted_forward_typed<scalar_t>(x, w, y, rows, len);
      });
}

void weighted_backward(
    const at::Tensor& grad_y,
    const at::Tensor& x,
    const at::Tensor& w,
    const at::Tensor& grad_x,
    const at::Tensor& grad_w,
    int64_t rows,
    int64_t len) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "weighted_swiglu_backward_cpu", [&] {
        weighted_backward_typed<scalar_t>(grad_y, x, w, grad_x, grad_w, rows, len);
      });
}

} // namespace CPU_CAPABILITY
} // namespace ascendspeed::swiglu
