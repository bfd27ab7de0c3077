// Flush-to-zero / denormals-are-zero (FTZ/DAZ) for the CPU's vector floating-point unit.
//
// ALiBi pushes distant keys' attention probabilities far below fp32's smallest normal number
// (1.2e-38). On many x86 cores every subnormal operand or result of a vector multiply or add costs a
// microcode assist of a hundred cycles or more, so attention on such data can run at half speed on one
// CPU and full speed on another. With FTZ/DAZ those values become zero: a change below 1.2e-38 in a
// probability, far under any output's resolution. The mode is a per-thread register (MXCSR on
// x86-64, FPCR on AArch64); elsewhere these are no-ops.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif
#include <cstdint>

namespace ascendspeed::cpu {

#if defined(__x86_64__) || defined(_M_X64)
constexpr unsigned kFlushToZero = 0x8000;
constexpr unsigned kDenormalsAreZero = 0x0040;

inline bool flush_subnormals_on_this_thread() {
  return (_mm_getcsr() & (kFlushToZero | kDenormalsAreZero)) == (kFlushToZero | kDenormalsAreZero);
}

inline void set_flush_subnormals_on_this_thread(bool enabled) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(enabled ? csr | kFlushToZero | kDenormalsAreZero : csr & ~(kFlushToZero | kDenormalsAreZero));
}
#elif defined(__aarch64__)
constexpr uint64_t kFlushToZero = uint64_t{1} << 24;  // FPCR.FZ: flushes inputs and results

inline uint64_t read_fpcr() {
  uint64_t fpcr;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
  return fpcr;
}

inline bool flush_subnormals_on_this_thread() {
  return (read_fpcr() & kFlushToZero) != 0;
}

inline void set_flush_subnormals_on_this_thread(bool enabled) {
  const uint64_t fpcr = enabled ? read_fpcr() | kFlushToZero : read_fpcr() & ~kFlushToZero;
  __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
}
#else
inline bool flush_subnormals_on_this_thread() {
  return false;
}

inline void set_flush_subnormals_on_this_thread(bool) {}
#endif

// FTZ/DAZ on the calling thread while it lives; the previous mode afterwards.
class FlushSubnormals {
 public:
  FlushSubnormals() : previous_(flush_subnormals_on_this_thread()) {
    set_flush_subnormals_on_this_thread(true);
  }
  ~FlushSubnormals() {
    set_flush_subnormals_on_this_thread(previous_);
  }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  bool previous_;
};

} // namespace ascendspeed::cpu
