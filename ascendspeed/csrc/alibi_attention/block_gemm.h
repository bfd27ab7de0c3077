// Row-major block matmuls of the ALiBi flash attention kernels:
//   C[m, n] = alpha * op(A)[m, k] op(B)[k, n] + beta * C,   op(X) = X or X^T,
// in fp32 or fp64 (the kernels widen bf16 / fp16 rows to fp32 first). Compiled for the baseline ISA:
// the BLAS it calls picks its own kernels at run time. ASCENDSPEED_ALIBI_GEMM=aten forces the fallback
// through at::addmm that builds without MKL use (tests check it).
#pragma once

#include <cstdint>

namespace ascendspeed::alibi_attention {

void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

} // namespace ascendspeed::alibi_attention
