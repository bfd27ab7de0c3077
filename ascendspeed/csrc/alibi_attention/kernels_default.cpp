// ALiBi flash attention CPU kernels for any CPU: at::vec's portable Vectorized, baseline ISA.
#include "alibi_attention_kernels.h"
#include "alibi_attention_prelude.h"

#define CPU_CAPABILITY DEFAULT
#include "alibi_attention_kernels_impl.h"

namespace ascendspeed::alibi_attention {

const CpuKernels* cpu_kernels_default() {
  static const CpuKernels kernels{&DEFAULT::forward, &DEFAULT::backward, "DEFAULT"};
  return &kernels;
}

} // namespace ascendspeed::alibi_attention
