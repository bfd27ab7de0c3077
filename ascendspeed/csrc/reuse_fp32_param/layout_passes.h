// The element passes of the bf16_split_ / bf16_join_ operators (bf16_split.cpp): what one thread does
// with a block of consecutive elements, and the order in which ranges of elements may run in parallel.
//
// Bits, with u the 32 bits of an fp32 value (little-endian: halves[2i] is its low half, halves[2i + 1]
// its high half):
//   high = u rounded to bf16, to nearest even (torch's and so Megatron's cast; every NaN becomes 0xFFFF,
//          as torch's CPU cast makes it),
//   low  = the low 16 bits of u,
//   u    = (high << 16) + low read as a signed number, plus 0x10000 for the exact ties (low == 0x8000)
//          that rounded down (high == u >> 16), whose positions are kept in a sorted list.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ascendspeed::reuse_fp32_param {

constexpr uint16_t kTieLow = 0x8000;
constexpr uint16_t kNanHigh = 0xFFFF;
constexpr int64_t kMaxBlock = 1024;

inline uint16_t rounded_high(uint32_t bits) {
  const uint32_t nearest_even = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? kNanHigh : static_cast<uint16_t>(nearest_even);
}

inline uint32_t joined_bits(uint16_t high, uint16_t low) {
  return (uint32_t{high} << 16) + static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(low)));
}

// How passes cut their ranges into blocks and threads. Only tests change it: one-element blocks run in
// descending order expose any overlap hazard inside a range that the ascending order would hide.
struct Schedule {
  int64_t block = kMaxBlock;
  int64_t grain = int64_t{1} << 14;
  bool descending_blocks = false;
};

Schedule& schedule();

// Calls block(first, count) over [begin, end), split across threads in chunks of at least the grain,
// each chunk in blocks of at most schedule().block elements. An element may overlap itself: a block
// whose targets overlap its sources reads them all before it writes.
template <typename Block>
void parallel_blocks(int64_t begin, int64_t end, const Block& block) {
  const Schedule plan = schedule();
  at::parallel_for(begin, end, plan.grain, [&](int64_t chunk_begin, int64_t chunk_end) {
    if (plan.descending_blocks) {
      for (int64_t last = chunk_end; last > chunk_begin; last -= plan.block) {
        const int64_t first = std::max(chunk_begin, last - plan.block);
        block(first, last - first);
      }
    } else {
      for (int64_t first = chunk_begin; first < chunk_end; first += plan.block) {
        block(first, std::min(plan.block, chunk_end - first));
      }
    }
  });
}

// Ranges [a, b) covering [first, last) in ascending order, one after the other, each run by `run`;
// end_of(a) is the largest safe end of the range starting at a. A range of one element is always safe
// (an element only ever overlaps itself), so each range has at least one.
template <typename EndOf, typename Run>
void ascending_ranges(int64_t first, int64_t last, const EndOf& end_of, const Run& run) {
  for (int64_t a = first; a < last;) {
    const int64_t b = std::min(last, std::max(a + 1, end_of(a)));
    run(a, b);
    a = b;
  }
}

// The same in descending order: begin_of(b) is the smallest safe begin of the range ending at b.
template <typename BeginOf, typename Run>
void descending_ranges(int64_t first, int64_t last, const BeginOf& begin_of, const Run& run) {
  for (int64_t b = last; b > first;) {
    const int64_t a = std::max(first, std::min(b - 1, begin_of(b)));
    run(a, b);
    b = a;
  }
}

// The fp32 values are read and written as 32-bit words of a buffer torch also accesses as int16.
typedef uint32_t __attribute__((__may_alias__)) aliased_uint32;

inline bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto a_begin = reinterpret_cast<uintptr_t>(a);
  const auto b_begin = reinterpret_cast<uintptr_t>(b);
  return a_begin < b_begin + b_bytes && b_begin < a_begin + a_bytes;
}

// The element loops: straight from source to target (vectorized; the restrict promises hold because
// the callers check that the regions do not overlap).
inline int split_values(
    const aliased_uint32* __restrict__ bits, uint16_t* __restrict__ high, uint16_t* __restrict__ low, int64_t count) {
  int maybe_tie = 0;
  for (int64_t j = 0; j < count; ++j) {
    high[j] = rounded_high(bits[j]);
    low[j] = static_cast<uint16_t>(bits[j]);
    maybe_tie |= low[j] == kTieLow;
  }
  return maybe_tie;
}

// The exact ties that rounded down among values whose low halves include at least one 0x8000 (about
// one block in 64 after an optimizer step: the list is sparse).
inline void collect_ties(
    int64_t first, int64_t count, const aliased_uint32* bits, const uint16_t* high, const uint16_t* low,
    std::vector<int64_t>& ties) {
  for (int64_t j = 0; j < count; ++j) {
    if (low[j] == kTieLow && high[j] == (bits[j] >> 16)) {
      ties.push_back(first + j);
    }
  }
}

inline void join_values(
    const uint16_t* __restrict__ high, const uint16_t* __restrict__ low, aliased_uint32* __restrict__ bits, int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    bits[j] = joined_bits(high[j], low[j]);
  }
}

// fp32 values -> (high, low). Element i is read from halves[2i, 2i + 2) and written to high[i] and
// low[i]. Slots [refill_begin, refill_end) of halves, once a block has read them, get
// refill[slot - refill_begin] (remainders that had to wait for the slot to be read).
struct SplitPass {
  uint16_t* halves;
  uint16_t* high;
  uint16_t* low;
  const uint16_t* refill = nullptr;
  int64_t refill_begin = 0;
  int64_t refill_end = 0;

  void operator()(int64_t first, int64_t count, std::vector<int64_t>& ties) const {
    const uint16_t* source = halves + 2 * first;
    const size_t source_bytes = sizeof(uint32_t) * count;
    const size_t target_bytes = sizeof(uint16_t) * count;
    uint16_t* high_target = high + first;
    uint16_t* low_target = low + first;
    if (!overlap(source, source_bytes, high_target, target_bytes) && !overlap(source, source_bytes, low_target, target_bytes)) {
      const auto* bits = reinterpret_cast<const aliased_uint32*>(source);
      if (split_values(bits, high_target, low_target, count)) {
        collect_ties(first, count, bits, high_target, low_target, ties);
      }
    } else {  // a value that overlaps its own halves (a range of one element): read it all first
      uint32_t bits[kMaxBlock];
      uint16_t high_block[kMaxBlock];
      uint16_t low_block[kMaxBlock];
      std::memcpy(bits, source, source_bytes);
      if (split_values(bits, high_block, low_block, count)) {
        collect_ties(first, count, bits, high_block, low_block, ties);
      }
      std::memcpy(high_target, high_block, target_bytes);
      std::memcpy(low_target, low_block, target_bytes);
    }
    const int64_t slots_begin = std::max(2 * first, refill_begin);
    const int64_t slots_end = std::min(2 * (first + count), refill_end);
    if (slots_begin < slots_end) {
      std::memcpy(halves + slots_begin, refill + (slots_begin - refill_begin), sizeof(uint16_t) * (slots_end - slots_begin));
    }
  }
};

// (high, low) -> fp32 values, without the ties (added afterwards). Element i is read from high[i] and
// low[i] and written to halves[2i, 2i + 2). Slots [stash_begin, stash_end) of halves are copied to
// stash[slot - stash_begin] before a block overwrites them (remainders still to be read).
struct JoinPass {
  uint16_t* halves;
  const uint16_t* high;
  const uint16_t* low;
  uint16_t* stash = nullptr;
  int64_t stash_begin = 0;
  int64_t stash_end = 0;

  void operator()(int64_t first, int64_t count) const {
    const int64_t slots_begin = std::max(2 * first, stash_begin);
    const int64_t slots_end = std::min(2 * (first + count), stash_end);
    if (slots_begin < slots_end) {
      std::memcpy(stash + (slots_begin - stash_begin), halves + slots_begin, sizeof(uint16_t) * (slots_end - slots_begin));
    }
    uint16_t* target = halves + 2 * first;
    const size_t target_bytes = sizeof(uint32_t) * count;
    const size_t source_bytes = sizeof(uint16_t) * count;
    if (!overlap(target, target_bytes, high + first, source_bytes) && !overlap(target, target_bytes, low + first, source_bytes)) {
      join_values(high + first, low + first, reinterpret_cast<aliased_uint32*>(target), count);
    } else {  // a value that overlaps its own halves (a range of one element): read it all first
      uint16_t high_block[kMaxBlock];
      uint16_t low_block[kMaxBlock];
      uint32_t bits[kMaxBlock];
      std::memcpy(high_block, high + first, source_bytes);
      std::memcpy(low_block, low + first, source_bytes);
      join_values(high_block, low_block, bits, count);
      std::memcpy(target, bits, target_bytes);
    }
  }
};

} // namespace ascendspeed::reuse_fp32_param
