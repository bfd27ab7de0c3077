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
using at::vec::Vectorized;

// s = 1 / (1 + exp(-a)). Where exp(-a) overflows (a below about -88 in fp32) s is 0 or a denormal:
// never NaN. fp32 math (also for bfloat16 and float16) uses ATen's inline exp_u20: silu(a) is then
// within 4.2e-7 relative of the exact value over [-90, 30] (ATen's own silu: 1.7e-7), and the loop
// keeps everything in registers instead of calling the out-of-line 1-ulp exp, which spills them and
// costs about twice as much in backward. fp64 keeps the 1-ulp exp.
template <typename Vec>
inline Vec sigmoid(const Vec& a) {
  const Vec one(1);
  if constexpr (std::is_same_v<Vec, Vectorized<float>>) {
    return one / (one + a.neg().exp_u20());
  } else {
    return one / (one + a.neg().exp());
  }
}

template <typename scalar_t>
void forward_span(const scalar_t* a, const scalar_t* b, scalar_t* y, int64_t n) {
  using B = Block<scalar_t>;
  for (int64_t i = 0; i < n; i += B::kSize) {
    const int64_t count = std::min(B::kSize, n - i);
    const auto va = B::load(a + i, count);
    const auto vb = B::load(b + i, count);
    typename B::Values vy;
    for (int p = 0; p < B::kParts; ++p) {
      vy[p] = va[p] * sigmoid(va[p]) * vb[p];
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

} // namespace CPU_CAPABILITY
} // namespace ascendspeed::swiglu
