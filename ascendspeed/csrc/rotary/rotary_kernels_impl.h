// The rotary-embedding CPU kernels, written once against at::vec::Vectorized and compiled once per
// instruction set. Only a kernels_<isa>.cpp includes this, inside its instruction-set region.
//
// t is streamed once (read t, write out). cos and sin are computed once per sequence position into
// small per-thread tables, in pair order, and reused for every batch entry and head of that position.
// Math is done in opmath_t: float for float/bfloat16/half, double for double.
#pragma once

#include "../common/vec_block.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace ascendspeed::rotary {
namespace CPU_CAPABILITY {
namespace {

using ascendspeed::vec::CPU_CAPABILITY::Block;

// Below this many elements a second thread costs more to wake than it saves.
constexpr int64_t kGrainSize = 32768;

// The coefficients of one sequence position, per feature pair k < half:
//   out_a = t_a * cos_a[k] + t_b * partner_a[k],   out_b = t_b * cos_b[k] + t_a * partner_b[k].
template <typename opmath_t>
class Tables {
 public:
  explicit Tables(int64_t half) : half_(half), tables_(4 * half), trig_(4 * half) {}

  // angles: the 2 * half angles of one sequence position, in feature order.
  void build(const opmath_t* angles, bool interleaved, bool transpose) {
    using Vec = at::vec::Vectorized<opmath_t>;
    const int64_t d_rot = 2 * half_;
    opmath_t* cosines = trig_.data();
    opmath_t* sines = cosines + d_rot;
    for (int64_t i = 0; i < d_rot; i += Vec::size()) {
      const int64_t count = std::min<int64_t>(Vec::size(), d_rot - i);
      const Vec angle = Vec::loadu(angles + i, count);
      angle.cos().store(cosines + i, count);
      angle.sin().store(sines + i, count);
    }
    for (int64_t k = 0; k < half_; ++k) {
      const int64_t a = interleaved ? 2 * k : k;
      const int64_t b = interleaved ? 2 * k + 1 : k + half_;
      cos_a()[k] = cosines[a];
      cos_b()[k] = cosines[b];
      partner_a()[k] = transpose ? sines[b] : -sines[a];
      partner_b()[k] = transpose ? -sines[a] : sines[b];
    }
  }

  opmath_t* cos_a() { return tables_.data(); }
  opmath_t* cos_b() { return tables_.data() + half_; }
  opmath_t* partner_a() { return tables_.data() + 2 * half_; }
  opmath_t* partner_b() { return tables_.data() + 3 * half_; }

 private:
  int64_t half_;
  std::vector<opmath_t> tables_;
  std::vector<opmath_t> trig_;
};

// One block of up to B::kSize pairs starting at pair k: the a and b features as opmath vectors.
template <typename scalar_t, typename Rotate>
void rotate_pairs(const scalar_t* in, scalar_t* out, int64_t half, bool interleaved, const Rotate& rotate) {
  using B = Block<scalar_t>;
  for (int64_t k = 0; k < half; k += B::kSize) {
    const int64_t count = std::min(B::kSize, half - k);
    if (!interleaved) {
      auto a = B::load(in + k, count);
      auto b = B::load(in + half + k, count);
      rotate(k, count, a, b);
      B::store(out + k, a, count);
      B::store(out + half + k, b, count);
      continue;
    }
    // 2 * count interleaved features [a0 b0 a1 b1 ...] as two blocks, split into a and b vectors.
    const int64_t first = std::min(B::kSize, 2 * count);
    const int64_t second = 2 * count - first;
    auto lo = B::load(in + 2 * k, first);
    auto hi = second > 0 ? B::load(in + 2 * k + B::kSize, second) : lo;
    typename B::Values a, b;
    for (int p = 0; p < B::kParts; ++p) {
      const auto& even = 2 * p < B::kParts ? lo[2 * p] : hi[2 * p - B::kParts];
      const auto& odd = 2 * p + 1 < B::kParts ? lo[2 * p + 1] : hi[2 * p + 1 - B::kParts];
      std::tie(a[p], b[p]) = at::vec::deinterleave2(even, odd);
    }
    rotate(k, count, a, b);
    for (int p = 0; p < B::kParts; ++p) {
      auto [even, odd] = at::vec::interleave2(a[p], b[p]);
      (2 * p < B::kParts ? lo[2 * p] : hi[2 * p - B::kParts]) = even;
      (2 * p + 1 < B::kParts ? lo[2 * p + 1] : hi[2 * p + 1 - B::kParts]) = odd;
    }
    B::store(out + 2 * k, lo, first);
    if (second > 0) {
      B::store(out + 2 * k + B::kSize, hi, second);
    }
  }
}

template <typename scalar_t>
void apply_typed(const at::Tensor& t, const at::Tensor& freqs, bool interleaved, bool transpose, const at::Tensor& out) {
  using B = Block<scalar_t>;
  using opmath_t = typename B::opmath_t;
  const int64_t seq = t.size(0), batch = t.size(1), heads = t.size(2), dim = t.size(3);
  const int64_t d_rot = freqs.size(-1), half = d_rot / 2;
  const int64_t stride_s = t.stride(0), stride_b = t.stride(1), stride_h = t.stride(2);
  const scalar_t* t_data = t.const_data_ptr<scalar_t>();
  const opmath_t* freqs_data = freqs.const_data_ptr<opmath_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, seq * batch, grain, [&](int64_t begin, int64_t end) {
    Tables<opmath_t> tables(half);
    int64_t tables_position = -1;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t position = index / batch;
      const int64_t entry = index % batch;
      if (position != tables_position) {
        tables.build(freqs_data + position * d_rot, interleaved, transpose);
        tables_position = position;
      }
      const opmath_t* cos_a = tables.cos_a();
      const opmath_t* cos_b = tables.cos_b();
      const opmath_t* partner_a = tables.partner_a();
      const opmath_t* partner_b = tables.partner_b();
      const auto rotate = [&](int64_t k, int64_t count, typename B::Values& a, typename B::Values& b) {
        const auto ca = B::load_opmath(cos_a + k, count);
        const auto cb = B::load_opmath(cos_b + k, count);
        const auto pa = B::load_opmath(partner_a + k, count);
        const auto pb = B::load_opmath(partner_b + k, count);
        for (int p = 0; p < B::kParts; ++p) {
          const auto new_a = a[p] * ca[p] + b[p] * pa[p];
          b[p] = b[p] * cb[p] + a[p] * pb[p];
          a[p] = new_a;
        }
      };
      for (int64_t head = 0; head < heads; ++head) {
        const scalar_t* in = t_data + position * stride_s + entry * stride_b + head * stride_h;
        scalar_t* row = out_data + (index * heads + head) * dim;
        rotate_pairs(in, row, half, interleaved, rotate);
        if (dim > d_rot) {
          std::memcpy(row + d_rot, in + d_rot, (dim - d_rot) * sizeof(scalar_t));
        }
      }
    }
  });
}

} // namespace

void apply(const at::Tensor& t, const at::Tensor& freqs, bool interleaved, bool transpose, const at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "rotary_embedding_cpu", [&] {
    apply_typed<scalar_t>(t, freqs, interleaved, transpose, out);
  });
}

} // namespace CPU_CAPABILITY
} // namespace ascendspeed::rotary
