// Block matmuls for the ALiBi flash attention kernels (see block_gemm.h).
//
// The kernels multiply many small blocks (128 x 256 x head_dim), so the cost of one call matters.
// torch's at::cpublas::gemm is not exported from libtorch, and a torch operator per block costs a
// dispatch and tensor construction each time. torch's x86-64 builds link MKL and export its BLAS
// entry points, so they are declared weak here and called directly when present; any other build
// falls back to at::addmm on views of the blocks.
//
// bf16 dot products go through at::native::cpublas (exported by libtorch_cpu, oneDNN inside): pack()
// writes a B operand in the VNNI layout, brgemm() multiplies, could_pack() says whether this CPU has
// the instructions.
#include "block_gemm.h"

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
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

enum class GemmChoice { kAuto, kMkl, kAten };

GemmChoice gemm_choice() {
  static const GemmChoice choice = [] {
    const char* name = std::getenv("ASCENDSPEED_ALIBI_GEMM");
    if (name == nullptr || *name == '\0' || std::strcmp(name, "auto") == 0) {
      return GemmChoice::kAuto;
    }
    if (std::strcmp(name, "mkl") == 0) {
      return GemmChoice::kMkl;
    }
    TORCH_CHECK_VALUE(
        std::strcmp(name, "aten") == 0, "ASCENDSPEED_ALIBI_GEMM must be auto, mkl or aten, got '", name, "'");
    return GemmChoice::kAten;
  }();
  return choice;
}

bool aten_forced() {
  return gemm_choice() == GemmChoice::kAten;
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

// oneDNN says it can pack bf16 for this CPU; one tiny product checks that it also multiplies, once per
// process, so that a CPU it misjudges keeps the widened route instead of failing inside attention.
bool bf16_products_work() {
  if (!at::native::cpublas::could_pack(at::kBFloat16)) {
    return false;
  }
  try {
    constexpr int64_t k = 2, n = 16;
    const std::vector<c10::BFloat16> a(k, c10::BFloat16(1.0f)), b(k * n, c10::BFloat16(0.5f));
    std::vector<c10::BFloat16> packed(k * n);
    std::vector<float> c(n, 0.0f);
    at::native::cpublas::pack(k, n, n, n, at::kBFloat16, at::kBFloat16, b.data(), packed.data());
    at::native::cpublas::brgemm(1, n, k, k, n, n, false, a.data(), packed.data(), c.data(), /*is_vnni=*/true);
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    return std::all_of(c.begin(), c.end(), [](float x) { return x == 1.0f; });
  } catch (const std::exception&) {
    return false;
  }
}

bool bf16_dot_products() {
  static const bool available = gemm_choice() == GemmChoice::kAuto && bf16_products_work();
  return available;
}

bool cpu_has_avx512_bf16() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
#else
  return false;
#endif
}

std::string bf16_matmul_description() {
  if (bf16_dot_products()) {
    return "bf16 dot products (oneDNN brgemm)";
  }
  return sgemm_ != nullptr && !aten_forced() ? "fp32 (MKL sgemm)" : "fp32 (at::addmm)";
}

void PackedBf16::pack(const c10::BFloat16* b, int64_t ld, int64_t k, int64_t n) {
  TORCH_INTERNAL_ASSERT(k % 2 == 0, "PackedBf16: k must be even, got ", k);
  k_ = k;
  n_ = n;
  packed_.resize(k * panel_stride(n));
  for (int64_t begin = 0; begin < n; begin += kPanel) {
    const int64_t width = std::min(kPanel, n - begin);
    at::native::cpublas::pack(k, width, ld, panel_stride(width), at::kBFloat16, at::kBFloat16, b + begin,
                              packed_.data() + begin * k);
  }
}

void PackedBf16::pack_transposed(const c10::BFloat16* x, int64_t stride, int64_t n, int64_t x_cols) {
  k_ = x_cols + (x_cols & 1);
  n_ = n;
  packed_.resize(k_ * panel_stride(n));
  tile_.resize(k_ * kPanel);
  // One panel at a time through a small tile: the transposing writes stay in L1.
  for (int64_t begin = 0; begin < n; begin += kPanel) {
    const int64_t width = std::min(kPanel, n - begin);
    transpose_rows(x + begin * stride, stride, width, x_cols, tile_.data(), width);
    std::fill(tile_.begin() + x_cols * width, tile_.begin() + k_ * width, c10::BFloat16(0.0f));
    at::native::cpublas::pack(k_, width, width, panel_stride(width), at::kBFloat16, at::kBFloat16, tile_.data(),
                              packed_.data() + begin * k_);
  }
}

void PackedBf16::multiply(const c10::BFloat16* a, int64_t lda, int64_t m, float* c, int64_t ldc, bool accumulate,
                          int64_t n_begin, int64_t n_end) const {
  TORCH_INTERNAL_ASSERT(n_begin % kPanel == 0 && n_end <= n_, "PackedBf16: columns must start a panel");
  for (int64_t begin = n_begin; begin < n_end; begin += kPanel) {
    const int64_t width = std::min(kPanel, n_ - begin);  // of the packed panel
    const int64_t used = std::min(width, n_end - begin);
    at::native::cpublas::brgemm(m, used, k_, lda, panel_stride(width), ldc, accumulate, a, packed_.data() + begin * k_,
                                c + (begin - n_begin), /*is_vnni=*/true);
  }
}

void release_bf16_dot_products() {
  at::native::cpublas::brgemm_release(/*is_vnni=*/true);
}

} // namespace ascendspeed::alibi_attention
