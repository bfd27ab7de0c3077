// The layout switches of --reuse-fp32-param as in-place torch operators on one int16 buffer:
//   ascendspeed::bf16_split_(halves, high_offset=0, low=None) -> ties
//     n fp32 values in halves[0, 2n) -> their bf16 roundings in halves[high_offset, high_offset + n),
//     their low 16 bits in `low` (or, without `low`, in halves[n, 2n), the bf16 ones then in
//     halves[0, n)), and the sorted int64 positions of the exact ties that rounded down;
//   ascendspeed::bf16_join_(halves, ties, high_offset=0, low=None)
//     the inverse: the exact fp32 values back into halves[0, 2n) (NaN stays NaN).
// One pass over memory each way, multi-threaded. The bit rules and the passes are in layout_passes.h;
// this file owns the schemas, the argument check (one function for the CPU and Meta kernels) and the
// order of the passes, which is what makes the overlap of the fp32 region with its own bf16 halves and
// remainders safe. The CUDA / NPU kernels (a torch composition) are registered from Python by
// ascendspeed/ops/bf16_split.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "layout_passes.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the fp32 halves are laid out little-endian");

namespace ascendspeed::reuse_fp32_param {

Schedule& schedule() {
  static Schedule current;
  return current;
}

namespace {

// The number of fp32 values of a call: low's length, or half of halves without low.
c10::SymInt value_count(const at::Tensor& halves, const std::optional<at::Tensor>& low) {
  return low.has_value() ? low->sym_numel() : halves.sym_numel() / 2;
}

// Every rejection of the arguments of both operators (ties only for bf16_join_); called by their CPU
// and Meta kernels (and so, through meta tensors, by the Python kernels of other devices).
void check_arguments(
    const char* op,
    const at::Tensor& halves,
    int64_t high_offset,
    const std::optional<at::Tensor>& low,
    const at::Tensor* ties) {
  TORCH_CHECK_TYPE(
      halves.scalar_type() == at::kShort,
      op, ": halves must be int16 (the buffer viewed with .view(torch.int16)), got ", halves.scalar_type());
  TORCH_CHECK_VALUE(
      halves.dim() == 1 && halves.is_contiguous(),
      op, ": halves must be 1-D and contiguous, got shape ", halves.sym_sizes(), " and strides ", halves.sym_strides());
  TORCH_CHECK_VALUE(
      halves.sym_storage_offset() % 2 == 0,
      op, ": halves must start at an even int16 offset of its storage (fp32 values are 4-byte aligned), got ",
      halves.sym_storage_offset());
  const c10::SymInt n = value_count(halves, low);
  if (low.has_value()) {
    TORCH_CHECK_TYPE(low->scalar_type() == at::kShort, op, ": low must be int16, got ", low->scalar_type());
    TORCH_CHECK_VALUE(
        low->dim() == 1 && low->is_contiguous(),
        op, ": low must be 1-D and contiguous, got shape ", low->sym_sizes(), " and strides ", low->sym_strides());
    TORCH_CHECK_VALUE(
        low->device() == halves.device(),
        op, ": low must be on the device of halves (", halves.device(), "), got ", low->device());
    if (!halves.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {  // torch's pairwise test needs sizes
      TORCH_CHECK_VALUE(
          at::get_overlap_status(*low, halves) == at::MemOverlapStatus::No,
          op, ": low must not share memory with halves; pass low=None for remainders in halves[n:2n]");
    }
    TORCH_CHECK_VALUE(
        2 * n <= halves.sym_numel(),
        op, ": halves must hold the ", n, " fp32 values of low's length (", 2 * n, " int16), got ",
        halves.sym_numel());
  } else {
    TORCH_CHECK_VALUE(
        halves.sym_numel() % 2 == 0,
        op, ": without low, halves holds n fp32 values and must have an even length, got ", halves.sym_numel());
    TORCH_CHECK_VALUE(
        high_offset == 0,
        op, ": without low the bf16 values are halves[0:n] and the remainders halves[n:2n]; high_offset must be 0, got ",
        high_offset);
  }
  TORCH_CHECK_INDEX(
      high_offset >= 0 && n + high_offset <= halves.sym_numel(),
      op, ": high_offset + n must lie within halves (length ", halves.sym_numel(), ", n = ", n,
      "), got high_offset ", high_offset);
  if (ties == nullptr) {
    return;
  }
  TORCH_CHECK_TYPE(ties->scalar_type() == at::kLong, op, ": ties must be int64 positions, got ", ties->scalar_type());
  TORCH_CHECK_VALUE(ties->dim() == 1, op, ": ties must be 1-D, got shape ", ties->sym_sizes());
  TORCH_CHECK_VALUE(
      ties->device() == halves.device(),
      op, ": ties must be on the device of halves (", halves.device(), "), got ", ties->device());
  if (ties->device().is_cpu()) {  // values: only where they are (the CPU kernel)
    const int64_t count = n.expect_int();
    const auto positions = ties->contiguous();
    const int64_t* tie = positions.const_data_ptr<int64_t>();
    for (int64_t k = 0; k < positions.numel(); ++k) {
      TORCH_CHECK_VALUE(
          tie[k] >= 0 && tie[k] < count && (k == 0 || tie[k] > tie[k - 1]),
          op, ": ties must be strictly increasing positions in [0, ", count,
          ") (as bf16_split_ returned them), got ", tie[k], " at index ", k);
    }
  }
}

uint16_t* halves_of(const at::Tensor& tensor) {
  return reinterpret_cast<uint16_t*>(tensor.data_ptr<int16_t>());
}

// Split with the remainders in their own tensor and the bf16 values at halves[H, H + n).
// Element i is read from [2i, 2i + 2) and its bf16 written to H + i, inside the fp32 value of element
// (H + i) / 2: after i for i < H (so those run in descending ranges), before i for i > H (ascending).
// The two groups never touch each other's values; the range bounds keep each write on a value already
// read, or on its own.
void split_shard(uint16_t* halves, int64_t n, int64_t high_offset, uint16_t* low, std::vector<std::vector<int64_t>>& ties) {
  const SplitPass pass{halves, halves + high_offset, low};
  const auto run = [&](int64_t a, int64_t b) {
    parallel_blocks(a, b, [&](int64_t first, int64_t count) { pass(first, count, ties[at::get_thread_num()]); });
  };
  const int64_t below = std::min(high_offset, n);
  descending_ranges(0, below, [&](int64_t b) { return 2 * b - high_offset; }, run);
  ascending_ranges(below, n, [&](int64_t a) { return 2 * a - high_offset; }, run);
}

// Join, the same layout: element i is read from H + i and written to [2i, 2i + 2), over the bf16 of
// elements 2i - H and 2i + 1 - H: after i for i > H (descending), before i for i < H (ascending).
void join_shard(uint16_t* halves, int64_t n, int64_t high_offset, const uint16_t* low) {
  const JoinPass pass{halves, halves + high_offset, low};
  const auto run = [&](int64_t a, int64_t b) { parallel_blocks(a, b, pass); };
  const int64_t below = std::min(high_offset, n);
  descending_ranges(below, n, [&](int64_t b) { return (high_offset + b + 1) / 2; }, run);
  ascending_ranges(0, below, [&](int64_t a) { return (high_offset + a) / 2; }, run);
}

// Split with the remainders in halves[n, 2n): the bf16 values need ascending order (as high_offset 0
// above), the remainders descending (as high_offset n). No order serves both, so the remainders of
// the first h = ceil(n / 2) elements wait in a stage of h int16 (1 byte per element):
//   1. elements [0, h) ascending: bf16 in place, remainders to the stage;
//   2. elements [h, n) descending: bf16 and remainders in place; a block that has read the values in
//      slots [n, n + h) refills them from the stage (for odd n, slot n after the loop).
void split_interleaved(uint16_t* halves, int64_t n, std::vector<std::vector<int64_t>>& ties) {
  const int64_t h = (n + 1) / 2;
  auto stage_tensor = at::empty({h}, at::TensorOptions().dtype(at::kShort));
  uint16_t* stage = halves_of(stage_tensor);
  const auto run_with = [&](const SplitPass& pass) {
    return [&, pass](int64_t a, int64_t b) {
      parallel_blocks(a, b, [&](int64_t first, int64_t count) { pass(first, count, ties[at::get_thread_num()]); });
    };
  };
  ascending_ranges(0, h, [](int64_t a) { return 2 * a; }, run_with(SplitPass{halves, halves, stage}));
  descending_ranges(
      h, n, [n](int64_t b) { return 2 * b - n; }, run_with(SplitPass{halves, halves, halves + n, stage, n, n + h}));
  std::memcpy(halves + n, stage, sizeof(uint16_t) * (2 * h - n));
}

// Join with the remainders in halves[n, 2n), the inverse order: elements [h, n) ascending write their
// values over the remainders and stash those of elements [0, h) first; then elements [0, h) descending
// read their remainders from the stash (for odd n, element 0's is stashed before anything moves).
void join_interleaved(uint16_t* halves, int64_t n) {
  const int64_t h = (n + 1) / 2;
  auto stage_tensor = at::empty({h}, at::TensorOptions().dtype(at::kShort));
  uint16_t* stage = halves_of(stage_tensor);
  std::memcpy(stage, halves + n, sizeof(uint16_t) * (2 * h - n));
  const JoinPass upper{halves, halves, halves + n, stage, n, n + h};
  ascending_ranges(h, n, [n](int64_t a) { return (n + a) / 2; }, [&](int64_t a, int64_t b) { parallel_blocks(a, b, upper); });
  const JoinPass lower{halves, halves, stage};
  descending_ranges(0, h, [](int64_t b) { return (b + 1) / 2; }, [&](int64_t a, int64_t b) { parallel_blocks(a, b, lower); });
}

at::Tensor bf16_split_cpu(const at::Tensor& halves, int64_t high_offset, const std::optional<at::Tensor>& low) {
  check_arguments("bf16_split_", halves, high_offset, low, nullptr);
  const int64_t n = value_count(halves, low).expect_int();
  std::vector<std::vector<int64_t>> ties(std::max(1, at::get_num_threads()));
  if (n > 0) {
    if (low.has_value()) {
      split_shard(halves_of(halves), n, high_offset, halves_of(*low), ties);
    } else {
      split_interleaved(halves_of(halves), n, ties);
    }
  }
  size_t count = 0;
  for (const auto& found : ties) {
    count += found.size();
  }
  auto positions = at::empty({static_cast<int64_t>(count)}, halves.options().dtype(at::kLong));
  int64_t* out = positions.data_ptr<int64_t>();
  for (const auto& found : ties) {
    out = std::copy(found.begin(), found.end(), out);
  }
  std::sort(positions.data_ptr<int64_t>(), positions.data_ptr<int64_t>() + count);
  return positions;
}

void bf16_join_cpu(
    const at::Tensor& halves, const at::Tensor& ties, int64_t high_offset, const std::optional<at::Tensor>& low) {
  check_arguments("bf16_join_", halves, high_offset, low, &ties);
  const int64_t n = value_count(halves, low).expect_int();
  if (n == 0) {
    return;
  }
  uint16_t* target = halves_of(halves);
  if (low.has_value()) {
    join_shard(target, n, high_offset, reinterpret_cast<const uint16_t*>(low->const_data_ptr<int16_t>()));
  } else {
    join_interleaved(target, n);
  }
  const auto positions = ties.contiguous();
  const int64_t* tie = positions.const_data_ptr<int64_t>();
  for (int64_t k = 0; k < positions.numel(); ++k) {
    target[2 * tie[k] + 1] += 1;  // u + 0x10000: the tie rounded down, its low half borrowed nothing
  }
}

// Checks only. The number of ties depends on the values, which meta tensors do not have: the operator
// is tagged dynamic_output_shape, so FakeTensor (torch.compile) never runs this kernel for it and
// breaks the graph instead, as for torch.nonzero; a direct call on meta tensors gets an empty list.
at::Tensor bf16_split_meta(const at::Tensor& halves, int64_t high_offset, const std::optional<at::Tensor>& low) {
  check_arguments("bf16_split_", halves, high_offset, low, nullptr);
  return at::empty({0}, halves.options().dtype(at::kLong));
}

void bf16_join_meta(
    const at::Tensor& halves, const at::Tensor& ties, int64_t high_offset, const std::optional<at::Tensor>& low) {
  check_arguments("bf16_join_", halves, high_offset, low, &ties);
}

// Test hook: block size, parallel grain and block order of the passes (see Schedule).
void set_schedule(int64_t block, int64_t grain, bool descending_blocks) {
  TORCH_CHECK_VALUE(block >= 1 && block <= kMaxBlock, "_bf16_split_schedule: block must be in [1, ", kMaxBlock, "]");
  TORCH_CHECK_VALUE(grain >= 1, "_bf16_split_schedule: grain must be >= 1");
  schedule() = Schedule{block, grain, descending_blocks};
}

} // namespace
} // namespace ascendspeed::reuse_fp32_param

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.bf16_split");
  m.def(
      "bf16_split_(Tensor(a!) halves, int high_offset=0, Tensor(b!)? low=None) -> Tensor",
      {at::Tag::pt2_compliant_tag, at::Tag::dynamic_output_shape});
  m.def(
      "bf16_join_(Tensor(a!) halves, Tensor ties, int high_offset=0, Tensor? low=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "_bf16_split_schedule(int block=1024, int grain=16384, bool descending_blocks=False) -> ()",
      &ascendspeed::reuse_fp32_param::set_schedule);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("bf16_split_", &ascendspeed::reuse_fp32_param::bf16_split_cpu);
  m.impl("bf16_join_", &ascendspeed::reuse_fp32_param::bf16_join_cpu);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("bf16_split_", &ascendspeed::reuse_fp32_param::bf16_split_meta);
  m.impl("bf16_join_", &ascendspeed::reuse_fp32_param::bf16_join_meta);
}
