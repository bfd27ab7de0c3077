// ascendspeed::shm_all_reduce_: all_reduce of a CPU tensor among processes of one host through a shared
// memory region, for the CPU ranks' process groups (ascendspeed/accelerator/cpu_shared_memory.py maps the
// region and decides when it serves a call). gloo moves every byte through a TCP socket and its own
// threads, about 1 GB/s between two processes; here each rank copies its data in once, reduces one
// partition of it from every rank's copy, and copies the reduced partitions out: memory bandwidth.
//
// Region layout (every rank maps the same bytes):
//   [0, 64)                     the barrier's arrival counter, a futex word
//   [64 (1 + r), 64 (2 + r))    rank r's line: its pid, then its own counts of barriers and chunks
//   [header_bytes, ...)         two buffers of `world` slots of `slot_bytes`, used by alternate chunks
// A chunk takes two barriers: after every rank copied its slot in (partitions may be reduced), and after
// every reduced partition is written (they may be copied out). Alternating buffers make the next chunk's
// copy-in safe without a third: a rank writes buffer b again only after the barrier of the chunk between,
// which every rank reaches after copying out of buffer b.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdint>
#include <ctime>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ascendspeed::cpu {
namespace {

constexpr int64_t kLine = 64;
constexpr int kSpins = 1000;
constexpr std::chrono::microseconds kYieldFor{500};

enum class Reduction : int64_t { kSum = 0, kAverage = 1, kMax = 2, kMin = 3 };

struct RankLine {
  int64_t pid;
  uint64_t barriers;
  uint64_t chunks;
};

int64_t header_bytes(int64_t world) {
  const int64_t bytes = kLine * (1 + world);
  return (bytes + 4095) / 4096 * 4096;
}

RankLine* rank_line(uint8_t* base, int64_t rank) {
  return reinterpret_cast<RankLine*>(base + kLine * (1 + rank));
}

void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Futex calls on a shared (not process-private) mapping: waiter and waker are different processes.
long futex_wait(uint32_t* word, uint32_t expected, const timespec* timeout) {
  return syscall(SYS_futex, word, FUTEX_WAIT, expected, timeout, nullptr, 0);
}

void futex_wake_all(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// A rank that died (a crash, a kill) never arrives: the waiters check their peers once a second, as gloo
// notices a closed connection, instead of waiting out the whole timeout.
void check_peers_alive(uint8_t* base, int64_t rank, int64_t world) {
  for (int64_t peer = 0; peer < world; ++peer) {
    const int64_t pid = rank_line(base, peer)->pid;
    TORCH_CHECK(peer == rank || kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH,
                "ascendspeed shared-memory all_reduce: rank ", peer, " of the group (pid ", pid,
                ") exited while rank ", rank, " waited for it");
  }
}

// Every rank of the group arrives once per barrier; the counter only grows (modulo 2^32), so barrier k is
// complete when it has reached k * world.
void barrier(uint8_t* base, int64_t rank, int64_t world, double timeout_s) {
  auto* arrived = reinterpret_cast<uint32_t*>(base);
  RankLine* line = rank_line(base, rank);
  const uint32_t target = static_cast<uint32_t>(++line->barriers * static_cast<uint64_t>(world));
  if (__atomic_add_fetch(arrived, 1u, __ATOMIC_ACQ_REL) == target) {
    futex_wake_all(arrived);
    return;
  }
  auto done = [&](uint32_t seen) { return static_cast<int32_t>(seen - target) >= 0; };
  for (int spin = 0; spin < kSpins; ++spin) {
    if (done(__atomic_load_n(arrived, __ATOMIC_ACQUIRE))) {
      return;
    }
    cpu_relax();
  }
  // Then yield for a while before sleeping: a rank asleep in the futex wakes through the scheduler (tens of
  // microseconds, more where the idle vCPU must be woken by the hypervisor), while the other ranks usually
  // arrive within the time of the slower rank's share of a chunk. Yielding lets other runnable ranks of an
  // oversubscribed host run meanwhile.
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < kYieldFor) {
    if (done(__atomic_load_n(arrived, __ATOMIC_ACQUIRE))) {
      return;
    }
    sched_yield();
  }
  auto last_check = start;
  const timespec slice{0, 50 * 1000 * 1000};
  while (true) {
    const uint32_t seen = __atomic_load_n(arrived, __ATOMIC_ACQUIRE);
    if (done(seen)) {
      return;
    }
    futex_wait(arrived, seen, &slice);
    const auto now = std::chrono::steady_clock::now();
    if (now - last_check > std::chrono::seconds(1)) {
      last_check = now;
      check_peers_alive(base, rank, world);
      TORCH_CHECK(std::chrono::duration<double>(now - start).count() < timeout_s,
                  "ascendspeed shared-memory all_reduce: rank ", rank, " waited more than ", timeout_s,
                  " s for the other ranks of its group (a rank that stopped calling collectives, or called "
                  "them in another order)");
    }
  }
}

at::Tensor slot(uint8_t* buffer, int64_t index, int64_t slot_bytes, int64_t numel, const at::TensorOptions& options) {
  return at::from_blob(buffer + index * slot_bytes, {numel}, options);
}

// Reduces partition `rank` of the chunk from every rank's slot into this rank's slot. Half types
// accumulate in fp32 and round once, as NCCL does.
void reduce_partition(uint8_t* buffer, int64_t rank, int64_t world, int64_t slot_bytes, int64_t numel,
                      int64_t begin, int64_t length, Reduction reduction, const at::TensorOptions& options) {
  if (length == 0) {
    return;
  }
  at::Tensor own = slot(buffer, rank, slot_bytes, numel, options).narrow(0, begin, length);
  const bool half = options.dtype() == at::kBFloat16 || options.dtype() == at::kHalf;
  const bool adds = reduction == Reduction::kSum || reduction == Reduction::kAverage;
  at::Tensor accumulator = half && adds ? own.to(at::kFloat) : own;
  for (int64_t peer = 0; peer < world; ++peer) {
    if (peer == rank) {
      continue;
    }
    const at::Tensor theirs = slot(buffer, peer, slot_bytes, numel, options).narrow(0, begin, length);
    if (adds) {
      accumulator.add_(theirs);
    } else if (reduction == Reduction::kMax) {
      at::maximum_out(accumulator, accumulator, theirs);
    } else {
      at::minimum_out(accumulator, accumulator, theirs);
    }
  }
  if (reduction == Reduction::kAverage) {
    accumulator.div_(static_cast<double>(world));
  }
  if (!accumulator.is_same(own)) {
    own.copy_(accumulator);
  }
}

void shm_all_reduce_(const at::Tensor& data, const at::Tensor& region, int64_t rank, int64_t world, int64_t slot_bytes,
                     int64_t reduction_code, double timeout_s) {
  TORCH_CHECK(data.device().is_cpu() && region.device().is_cpu(), "shm_all_reduce_ takes CPU tensors");
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous(), "shm_all_reduce_: region is a flat uint8 tensor");
  TORCH_CHECK(0 <= rank && rank < world, "shm_all_reduce_: rank ", rank, " is not in a group of ", world);
  TORCH_CHECK(0 <= reduction_code && reduction_code <= 3, "shm_all_reduce_: unknown reduction ", reduction_code);
  TORCH_CHECK(slot_bytes % data.element_size() == 0 && slot_bytes >= data.element_size() * world,
              "shm_all_reduce_: slot_bytes ", slot_bytes, " does not hold whole elements for every rank");
  TORCH_CHECK(region.numel() >= header_bytes(world) + 2 * world * slot_bytes, "shm_all_reduce_: region of ",
              region.numel(), " bytes is too small for ", world, " ranks of ", slot_bytes, " bytes");
  const auto reduction = static_cast<Reduction>(reduction_code);
  uint8_t* base = region.data_ptr<uint8_t>();
  uint8_t* buffers = base + header_bytes(world);
  RankLine* line = rank_line(base, rank);
  const at::TensorOptions options = data.options();
  at::Tensor flat = data.is_contiguous() ? data.view({-1}) : data.contiguous().view({-1});
  const int64_t total = flat.numel();
  const int64_t chunk_numel = slot_bytes / data.element_size();
  for (int64_t start = 0; start < total; start += chunk_numel) {
    const int64_t numel = std::min(chunk_numel, total - start);
    uint8_t* buffer = buffers + static_cast<int64_t>(line->chunks++ & 1) * world * slot_bytes;
    slot(buffer, rank, slot_bytes, numel, options).copy_(flat.narrow(0, start, numel));
    barrier(base, rank, world, timeout_s);
    const int64_t share = numel / world, extra = numel % world;
    auto begin_of = [&](int64_t part) { return part * share + std::min(part, extra); };
    auto length_of = [&](int64_t part) { return share + (part < extra ? 1 : 0); };
    reduce_partition(buffer, rank, world, slot_bytes, numel, begin_of(rank), length_of(rank), reduction, options);
    barrier(base, rank, world, timeout_s);
    for (int64_t part = 0; part < world; ++part) {
      if (length_of(part) > 0) {
        flat.narrow(0, start + begin_of(part), length_of(part))
            .copy_(slot(buffer, part, slot_bytes, numel, options).narrow(0, begin_of(part), length_of(part)));
      }
    }
  }
  if (!data.is_contiguous()) {
    data.copy_(flat.view(data.sizes()));
  }
}

// For the Python side, which lays out the region: the bytes before the first buffer.
int64_t shm_all_reduce_header_bytes(int64_t world) {
  return header_bytes(world);
}

// Each rank writes its pid into its line once the region is mapped (the liveness checks read them).
void shm_all_reduce_register_rank(const at::Tensor& region, int64_t rank, int64_t world) {
  TORCH_CHECK(region.numel() >= header_bytes(world) && 0 <= rank && rank < world, "shm_all_reduce_register_rank: ",
              "bad region or rank");
  __atomic_store_n(&rank_line(region.data_ptr<uint8_t>(), rank)->pid, static_cast<int64_t>(getpid()),
                   __ATOMIC_RELEASE);
}

} // namespace
} // namespace ascendspeed::cpu

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.def("shm_all_reduce_(Tensor(a!) data, Tensor region, int rank, int world, int slot_bytes, int reduction, "
        "float timeout_s) -> ()");
  m.def("shm_all_reduce_header_bytes(int world) -> int", &ascendspeed::cpu::shm_all_reduce_header_bytes);
  m.def("shm_all_reduce_register_rank(Tensor region, int rank, int world) -> ()",
        &ascendspeed::cpu::shm_all_reduce_register_rank);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("shm_all_reduce_", &ascendspeed::cpu::shm_all_reduce_);
}
