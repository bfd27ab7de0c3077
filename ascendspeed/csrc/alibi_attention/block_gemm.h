// Row-major block matmuls of the ALiBi flash attention kernels:
//   C[m, n] = alpha * op(A)[m, k] op(B)[k, n] + beta * C,   op(X) = X or X^T,
// with C in opmath (fp32; fp64 for fp64) and A, B in the input dtype (bf16/fp16 products accumulate in
// fp32). Compiled for the baseline ISA: the BLAS it calls picks its own kernels at run time.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace ascendspeed::alibi_attention {

void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);
void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
               const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, float beta, float* c,
               int64_t ldc);
void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
               const c10::Half* a, int64_t lda, const c10::Half* b, int64_t ldb, float beta, float* c,
               int64_t ldc);

// "mkl" when the BLAS entry points torch's x86-64 builds export are used, "aten" for the fallback
// through at::addmm (any torch build; slower per call). ASCENDSPEED_ALIBI_GEMM=aten forces the fallback.
const char* gemm_backend();

} // namespace ascendspeed::alibi_attention
