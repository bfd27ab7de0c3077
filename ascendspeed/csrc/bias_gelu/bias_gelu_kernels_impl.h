// The bias-GeLU CPU kernels, written once against at::vec::Vectorized and compiled once per instruction
// set. Only a kernels_<isa>.cpp includes this, inside its instruction-set region.
//
// One pass over memory each way: forward reads y (and the bias row, which stays in cache) and writes the
// output; backward reads the gradient and y and writes the gradient of y. Math in opmath_type (float for
// float/bfloat16/half, double for double): bias + y is formed there, so a half-precision sum is not
// rounded before GeLU's tail amplifies it, and the result is rounded once.
#pragma once

#include "../common/vec_block.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

namespace ascendspeed::bias_gelu {
namespace CPU_CAPABILITY {
namespace {

using ascendspeed::vec::CPU_CAPABILITY::Block;
using ascendspeed::vec::CPU_CAPABILITY::sigmoid;  // 0 or a denormal where exp overflows, never NaN
using at::vec::Vectorized;

// Megatron's constants (megatron.core.fusions.fused_bias_gelu): sqrt(2 / pi) and 0.044715; the derivative's
// cubic slope is 3 * 0.044715 * sqrt(2 / pi).
constexpr double kSqrt2OverPi = 0.79788456;
constexpr double kCubic = 0.044715;
constexpr double kCubicSlope = 0.1070322243;

// sigmoid(2u) for x: 0.5 * (1 + tanh(u)) = sigmoid(2u).
template <typename Vec>
inline Vec gate(const Vec& x) {
  const Vec two_k(2 * kSqrt2OverPi);
  const Vec c(kCubic);
  const Vec one(1);
  return sigmoid(two_k * x * at::vec::fmadd(c * x, x, one));
}

template <typename scalar_t>
void forward_row(const scalar_t* y, const scalar_t* bias, scalar_t* out, int64_t n) {
  using B = Block<scalar_t>;
  for (int64_t i = 0; i < n; i += B::kSize) {
    const int64_t count = std::min(B::kSize, n - i);
    const auto vy = B::load(y + i, count);
    const auto vb = B::load(bias + i, count);
    typename B::Values vo;
    for (int p = 0; p < B::kParts; ++p) {
      const auto x = vy[p] + vb[p];
      vo[p] = x * gate(x);
    }
    B::store(out + i, vo, count);
  }
}

template <typename scalar_t>
void backward_row(const scalar_t* g, const scalar_t* y, const scalar_t* bias, scalar_t* dy, int64_t n) {
  using B = Block<scalar_t>;
  using Vec = typename B::Vec;
  const Vec one(1);
  const Vec two(2);
  const Vec k(kSqrt2OverPi);
  const Vec slope(kCubicSlope);
  for (int64_t i = 0; i < n; i += B::kSize) {
    const int64_t count = std::min(B::kSize, n - i);
    const auto vg = B::load(g + i, count);
    const auto vy = B::load(y + i, count);
    const auto vb = B::load(bias + i, count);
    typename B::Values vd;
    for (int p = 0; p < B::kParts; ++p) {
      const Vec x = vy[p] + vb[p];
      const Vec s = gate(x);
      const Vec du = at::vec::fmadd(slope * x, x, k);
      vd[p] = vg[p] * (s + two * x * s * (one - s) * du);
    }
    B::store(dy + i, vd, count);
  }
}

// Below this many outputs a second thread costs more to wake than it saves (ATen's own grain for
// elementwise kernels).
constexpr int64_t kGrainSize = 32768;

template <typename F>
void parallel_rows(int64_t rows, int64_t len, const F& row) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(len, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       row(r);
                     }
                   });
}

} // namespace

void forward(const at::Tensor& y, const at::Tensor& bias, const at::Tensor& out, int64_t rows, int64_t len) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "bias_gelu_cpu", [&] {
    const scalar_t* y_data = y.const_data_ptr<scalar_t>();
    const scalar_t* b_data = bias.const_data_ptr<scalar_t>();
    scalar_t* o_data = out.mutable_data_ptr<scalar_t>();
    parallel_rows(rows, len, [&](int64_t r) {
      forward_row(y_data + r * len, b_data, o_data + r * len, len);
    });
  });
}

void backward(
    const at::Tensor& grad,
    const at::Tensor& y,
    const at::Tensor& bias,
    const at::Tensor& grad_y,
    int64_t rows,
    int64_t len) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "bias_gelu_backward_cpu", [&] {
    const scalar_t* g_data = grad.const_data_ptr<scalar_t>();
    const scalar_t* y_data = y.const_data_ptr<scalar_t>();
    const scalar_t* b_data = bias.const_data_ptr<scalar_t>();
    scalar_t* d_data = grad_y.mutable_data_ptr<scalar_t>();
    parallel_rows(rows, len, [&](int64_t r) {
      backward_row(g_data + r * len, y_data + r * len, b_data, d_data + r * len, len);
    });
  });
}

} // namespace CPU_CAPABILITY
} // namespace ascendspeed::bias_gelu
