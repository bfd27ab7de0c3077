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
#include <vector>

namespace ascendspeed::rotary {
namespace CPU_CAPABILITY {
namespace {

using ascendspeed::vec::CPU_CAPABILITY::Block;
using ascendspeed::vec::CPU_CAPABILITY::swap_adjacent;

// Below this many elements a second thread costs more to wake than it saves.
constexpr int64_t kGrainSize = 32768;

// The coefficients of one sequence position, in feature order j < d_rot, with mate(j) the other
// feature of j's pair (j +- d_rot / 2, or j ^ 1 interleaved):
//   out[j] = t[j] * cosine[j] + t[mate(j)] * partner[j].
// Forward: partner[j] = -sin f_j for the first feature of a pair, +sin f_j for the second; the
// transpose (backward) uses partner[mate(j)] instead.
template <typename opmath_t>
class Tables {
 public:
  explicit Tables(int64_t d_rot) : d_rot_(d_rot), cosine_(d_rot), partner_(d_rot), sine_(d_rot) {}

  // angles: the d_rot angles of one sequence position, in feature order.
  void build(const opmath_t* angles, bool interleaved, bool transpose) {
    using Vec = at::vec::Vectorized<opmath_t>;
    for (int64_t j = 0; j < d_rot_; j += Vec::size()) {
      const int64_t count = std::min<int64_t>(Vec::size(), d_rot_ - j);
      const Vec angle = Vec::loadu(angles + j, count);
      angle.cos().store(cosine_.data() + j, count);
      angle.sin().store(sine_.data() + j, count);
    }
    const int64_t half = d_rot_ / 2;
    for (int64_t j = 0; j < d_rot_; ++j) {
      const bool first = interleaved ? j % 2 == 0 : j < half;
      const int64_t mate = interleaved ? j ^ 1 : (first ? j + half : j - half);
      // the forward partner of feature i is -sin f_i (first of its pair) or +sin f_i (second)
      partner_[j] = transpose ? (first ? sine_[mate] : -sine_[mate]) : (first ? -sine_[j] : sine_[j]);
    }
  }

  const opmath_t* cosine() const { return cosine_.data(); }
  const opmath_t* partner() const { return partner_.data(); }

 private:
  int64_t d_rot_;
  std::vector<opmath_t> cosine_;
  std::vector<opmath_t> partner_;
  std::vector<opmath_t> sine_;
};

// Pairs (j, j + half): the two halves of a row are blocks of the same positions, so out needs no
// shuffle: out_a = a cos_a + b partner_a, out_b = b cos_b + a partner_b, a block of pairs at a time.
template <typename scalar_t>
void rotate_halves(const scalar_t* in, scalar_t* out, const Tables<at::opmath_type<scalar_t>>& tables, int64_t half) {
  using B = Block<scalar_t>;
  const auto* cosine = tables.cosine();
  const auto* partner = tables.partner();
  for (int64_t k = 0; k < half; k += B::kSize) {
    const int64_t count = std::min(B::kSize, half - k);
    const auto a = B::load(in + k, count);
    const auto b = B::load(in + half + k, count);
    const auto cos_a = B::load_opmath(cosine + k, count);
    const auto cos_b = B::load_opmath(cosine + half + k, count);
    const auto partner_a = B::load_opmath(partner + k, count);
    const auto partner_b = B::load_opmath(partner + half + k, count);
    typename B::Values out_a, out_b;
    for (int p = 0; p < B::kParts; ++p) {
      out_a[p] = at::vec::fmadd(b[p], partner_a[p], a[p] * cos_a[p]);
      out_b[p] = at::vec::fmadd(a[p], partner_b[p], b[p] * cos_b[p]);
    }
    B::store(out + k, out_a, count);
    B::store(out + half + k, out_b, count);
  }
}

// Interleaved pairs (2k, 2k + 1): each vector holds whole pairs, and its mates are the same vector
// with adjacent elements swapped (one in-lane shuffle), so out = t cos + swap(t) partner.
template <typename scalar_t>
void rotate_interleaved(
    const scalar_t* in,
    scalar_t* out,
    const Tables<at::opmath_type<scalar_t>>& tables,
    int64_t d_rot) {
  using B = Block<scalar_t>;
  const auto* cosine = tables.cosine();
  const auto* partner = tables.partner();
  for (int64_t j = 0; j < d_rot; j += B::kSize) {
    const int64_t count = std::min(B::kSize, d_rot - j);
    auto v = B::load(in + j, count);
    const auto c = B::load_opmath(cosine + j, count);
    const auto s = B::load_opmath(partner + j, count);
    for (int p = 0; p < B::kParts; ++p) {
      v[p] = at::vec::fmadd(swap_adjacent(v[p]), s[p], v[p] * c[p]);
    }
    B::store(out + j, v, count);
  }
}

template <typename scalar_t>
void apply_typed(const at::Tensor& t, const at::Tensor& freqs, bool interleaved, bool transpose, const at::Tensor& out) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t seq = t.size(0), batch = t.size(1), heads = t.size(2), dim = t.size(3);
  const int64_t d_rot = freqs.size(-1);
  const int64_t stride_s = t.stride(0), stride_b = t.stride(1), stride_h = t.stride(2);
  const scalar_t* t_data = t.const_data_ptr<scalar_t>();
  const opmath_t* freqs_data = freqs.const_data_ptr<opmath_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, seq * batch, grain, [&](int64_t begin, int64_t end) {
    Tables<opmath_t> tables(d_rot);
    int64_t tables_position = -1;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t position = index / batch;
      const int64_t entry = index % batch;
      if (position != tables_position) {
        tables.build(freqs_data + position * d_rot, interleaved, transpose);
        tables_position = position;
      }
      for (int64_t head = 0; head < heads; ++head) {
        const scalar_t* in = t_data + position * stride_s + entry * stride_b + head * stride_h;
        scalar_t* row = out_data + (index * heads + head) * dim;
        if (interleaved) {
          rotate_interleaved(in, row, tables, d_rot);
        } else {
          rotate_halves(in, row, tables, d_rot / 2);
        }
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
