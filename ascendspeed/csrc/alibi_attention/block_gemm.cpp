// Block matmuls for the ALiBi flash attention kernels (see block_gemm.h).
//
// The kernels multiply many small blocks (128 x 256 x head_dim), so the cost of one call matters.
// torch's at::cpublas::gemm is not exported from libtorch, and a torch operator per block costs a
// dispatch and tensor construction each time. torch's x86-64 builds link MKL and export its BLAS
// entry points, so they are declared weak here and called directly when present; any other build
// falls back to at::addmm on views of the blocks.
#include "block_gemm.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <limits>

extern "C" {
// Fortran BLAS (column-major, 32-bit integers).
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}

namespace ascendspeed::alibi_attention {
namespace {

bool aten_forced() {
  static const bool forced = [] {
    const char* choice = std::getenv("ASCENDSPEED_ALIBI_GEMM");
    return choice != nullptr && std::strcmp(choice, "aten") == 0;
  }();
  return forced;
}

bool fits_int(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  return m <= kMax && n <= kMax && k <= kMax && lda <= kMax && ldb <= kMax && ldc <= kMax;
}

// A row-major [rows, cols] block with leading dimension ld, viewed as op(X).
at::Tensor block_view(const void* data, bool transpose, int64_t rows, int64_t cols, int64_t ld, at::ScalarType dtype) {
  auto view = at::from_blob(const_cast<void*>(data), {transpose ? cols : rows, transpose ? rows : cols}, {ld, 1},
                            at::TensorOptions().dtype(dtype));
  return transpose ? view.t() : view;
}

template <typename acc_t>
void gemm_rows_aten(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, acc_t alpha, const void* a,
                    int64_t lda, const void* b, int64_t ldb, acc_t beta, acc_t* c, int64_t ldc, at::ScalarType dtype) {
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  auto out = at::from_blob(c, {m, n}, {ldc, 1}, at::TensorOptions().dtype(acc_dtype));
  const auto lhs = block_view(a, transpose_a, m, k, lda, dtype).to(acc_dtype);
  const auto rhs = block_view(b, transpose_b, k, n, ldb, dtype).to(acc_dtype);
  out.addmm_(lhs, rhs, beta, alpha);
}

// Fortran BLAS is column-major: the column-major view of a row-major matrix is its transpose, so
// row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, the operands swapped.
template <typename acc_t, typename Gemm>
void fortran_gemm_rows(Gemm gemm, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, acc_t alpha,
                       const acc_t* a, int64_t lda, const acc_t* b, int64_t ldb, acc_t beta, acc_t* c, int64_t ldc) {
  const char ta = transpose_b ? 'T' : 'N', tb = transpose_a ? 'T' : 'N';
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  const int lda_i = static_cast<int>(ldb), ldb_i = static_cast<int>(lda), ldc_i = static_cast<int>(ldc);
  gemm(&ta, &tb, &mi, &ni, &ki, &alpha, b, &lda_i, a, &ldb_i, &beta, c, &ldc_i);
}

} // namespace

void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (sgemm_ == nullptr || aten_forced() || !fits_int(m, n, k, lda, ldb, ldc)) {
    gemm_rows_aten<float>(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, at::kFloat);
    return;
  }
  fortran_gemm_rows<float>(sgemm_, transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  if (dgemm_ == nullptr || aten_forced() || !fits_int(m, n, k, lda, ldb, ldc)) {
    gemm_rows_aten<double>(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, at::kDouble);
    return;
  }
  fortran_gemm_rows<double>(dgemm_, transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

} // namespace ascendspeed::alibi_attention
