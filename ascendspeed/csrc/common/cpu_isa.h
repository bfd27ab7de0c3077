// Shared by the operators with per-instruction-set kernels (cpu_isa_kernels.h): the choice
// of kernels and the allocation of large outputs. Compiled for the baseline ISA (include it from the
// operator's .cpp, not from a kernels_<isa>.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>

#include <cstdint>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace ascendspeed::cpu {

// The widest of an operator's kernel tables that torch itself uses on this CPU (ATEN_CPU_CAPABILITY
// lowers it, as for torch). A table is nullptr when this build has no kernels for that instruction set.
template <typename Kernels>
const Kernels& widest_kernels(const Kernels* avx512, const Kernels* avx2, const Kernels* fallback) {
  const std::string isa = at::get_cpu_capability();
  if (isa == "AVX512" && avx512 != nullptr) {
    return *avx512;
  }
  if ((isa == "AVX512" || isa == "AVX2") && avx2 != nullptr) {
    return *avx2;
  }
  return *fallback;
}

// A fresh output of many megabytes is first touched by the kernel, and on Linux each of its 4 KiB
// pages then faults on its own: for a 64 MB output that costs about as much as streaming it. Huge
// pages cut the faults 512-fold, as torch's THP_MEM_ALLOC_ENABLE=1 does for all its allocations; here
// only the 2 MiB-aligned interior of our own large outputs is advised, before anything touches it.
// Buffers of 32 MiB and more are private mappings of their own in glibc (its mmap threshold never
// exceeds that), so the advice never reaches pages of the shared heap. Advice only: errors are ignored.
inline void advise_huge_pages(const at::Tensor& output) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  constexpr size_t kMinBytes = size_t{32} << 20;
  const size_t bytes = output.storage().nbytes();
  if (bytes >= kMinBytes) {
    const auto begin = reinterpret_cast<uintptr_t>(output.storage().data());
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + bytes) & ~(kHugePage - 1);
    if (first < last) {
      madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
    }
  }
#endif
}

inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  auto output = at::empty(sizes, options);
  advise_huge_pages(output);
  return output;
}

inline at::Tensor empty_output(at::IntArrayRef sizes, at::IntArrayRef strides, const at::TensorOptions& options) {
  auto output = at::empty_strided(sizes, strides, options);
  advise_huge_pages(output);
  return output;
}

// "AVX512, multi-threaded": how an operator's CPU kernels run, for tests and benchmarks.
// at::parallel_for is inline: with torch's OpenMP backend it runs on one thread unless this extension
// itself is compiled with -fopenmp (setup.py does).
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#warning "ascendspeed._C is built without -fopenmp: at::parallel_for runs the CPU kernels on one thread"
#endif
inline std::string describe_kernels(const char* isa) {
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
  return std::string(isa) + ", single-threaded (built without -fopenmp)";
#else
  return std::string(isa) + ", multi-threaded";
#endif
}

} // namespace ascendspeed::cpu
