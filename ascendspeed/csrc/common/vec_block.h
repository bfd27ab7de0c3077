// Loads and stores of scalar_t elements as opmath vectors (float for float/bfloat16/half, double for
// double), for kernels written once against at::vec::Vectorized and compiled once per instruction
// set. Include it inside an instruction-set region (after CPU_CAPABILITY is defined): everything here
// is then built for that instruction set, in a namespace of its own.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace ascendspeed::vec {
namespace CPU_CAPABILITY {

using at::vec::Vectorized;

// One block of scalar_t elements as opmath vectors: a Vectorized<BFloat16> holds twice as many
// elements as a Vectorized<float>, so reduced types convert to and from two float vectors, in order.
template <typename scalar_t>
struct Block {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<opmath_t>;
  static constexpr bool kReduced = c10::is_reduced_floating_point_v<scalar_t>;
  static constexpr int kParts = kReduced ? 2 : 1;
  static constexpr int64_t kSize = Vectorized<scalar_t>::size();
  using Values = std::array<Vec, kParts>;

  // `count` <= kSize; a partial block touches only `count` elements and reads the others as 0.
  static Values load(const scalar_t* p, int64_t count = kSize) {
    const auto v = Vectorized<scalar_t>::loadu(p, count);
    if constexpr (kReduced) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(v);
      return {lo, hi};
    } else {
      return {v};
    }
  }

  static void store(scalar_t* p, const Values& v, int64_t count = kSize) {
    if constexpr (kReduced) {
      at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p, count);
    } else {
      v[0].store(p, count);
    }
  }

  // The opmath vectors of a block from an opmath array (weights, tables), `count` elements from p.
  static Values load_opmath(const opmath_t* p, int64_t count = kSize) {
    Values v;
    for (int part = 0; part < kParts; ++part) {
      const int64_t offset = part * Vec::size();
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(Vec::size(), count - offset));
      v[part] = Vec::loadu(p + offset, n);
    }
    return v;
  }

  static void store_opmath(opmath_t* p, const Values& v, int64_t count = kSize) {
    for (int part = 0; part < kParts; ++part) {
      const int64_t offset = part * Vec::size();
      const int64_t n = std::min<int64_t>(Vec::size(), count - offset);
      if (n > 0) {
        v[part].store(p + offset, n);
      }
    }
  }
};

// v with elements 2k and 2k + 1 exchanged, for every k: the mates of interleaved pairs.
template <typename T>
Vectorized<T> swap_adjacent(const Vectorized<T>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_permute_ps(v, 0b10110001);
  } else if constexpr (std::is_same_v<T, double>) {
    return _mm512_permute_pd(v, 0b01010101);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_permute_ps(v, 0b10110001);
  } else if constexpr (std::is_same_v<T, double>) {
    return _mm256_permute_pd(v, 0b0101);
  }
#endif
  static_assert(Vectorized<T>::size() % 2 == 0, "pairs must not straddle vectors");
  std::array<T, Vectorized<T>::size()> values;
  v.store(values.data());
  for (size_t k = 0; k + 1 < values.size(); k += 2) {
    std::swap(values[k], values[k + 1]);
  }
  return Vectorized<T>::loadu(values.data());
}

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

} // namespace CPU_CAPABILITY
} // namespace ascendspeed::vec
