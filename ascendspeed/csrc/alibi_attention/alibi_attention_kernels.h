// The contract between the ALiBi flash attention operator (alibi_attention.cpp) and its CPU kernels.
//
// The kernels are compiled once per instruction set (kernels_default.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp) because their softmax loops are vector code; the block matmuls go through
// block_gemm.h, whose BLAS picks its own kernels at run time. The operator checks every argument
// before calling a kernel: q, k, v and grad_out are [batch, heads, seq, head_dim] with a unit-stride
// last dimension (any other strides), lse is contiguous [batch, heads, sq] fp32 (fp64 for fp64
// inputs), slopes a contiguous fp32 vector of one slope per head, q_offset >= 0.
#pragma once

#include <ATen/core/Tensor.h>

// Included here, before a kernels_<isa>.cpp switches instruction set, so that block_gemm.h's inline code
// (PackedBf16's members, transpose_rows) is compiled for the baseline ISA in every translation unit and
// any copy the linker keeps runs on any CPU (see ../common/cpu_isa_prelude.h).
#include "block_gemm.h"

namespace ascendspeed::alibi_attention {

struct CpuKernels {
  // out = softmax(q k^T * scale - slope * (q_pos - k_pos), causal) v and lse, the natural log of
  // each row's softmax denominator (with the row maximum folded in), which is all backward needs.
  void (*forward)(
      const at::Tensor& q,
      const at::Tensor& k,
      const at::Tensor& v,
      const at::Tensor& slopes,
      double scale,
      int64_t q_offset,
      const at::Tensor& out,
      const at::Tensor& lse);
  // Recomputes the probabilities block by block from q, k and lse; writes grad_q, grad_k, grad_v.
  void (*backward)(
      const at::Tensor& grad_out,
      const at::Tensor& q,
      const at::Tensor& k,
      const at::Tensor& v,
      const at::Tensor& out,
      const at::Tensor& lse,
      const at::Tensor& slopes,
      double scale,
      int64_t q_offset,
      const at::Tensor& grad_q,
      const at::Tensor& grad_k,
      const at::Tensor& grad_v);
  // Whether these kernels round fp32 to bf16 with AVX512-BF16's instruction on this CPU (bf16 dot products).
  bool (*native_bf16_conversion)();
  const char* isa;
};

// nullptr when this build has no kernels for that instruction set (another compiler or CPU family).
const CpuKernels* cpu_kernels_default();
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();

} // namespace ascendspeed::alibi_attention
