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

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
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

bool cpu_has_avx512_bf16() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
#else
  return false;
#endif
}

namespace {

// Who writes B in the layout the bf16 dot products read (pairs of rows interleaved). With AMX, oneDNN
// packs (at::native::cpublas::pack; could_pack() is true). With AVX512-BF16 alone (AMD Zen 4, Intel
// Cooper Lake) oneDNN's brgemm reads the same pairs but has no packing routine for them ("No need to
// pack"), so they are interleaved here.
enum class Bf16Packing { kNone, kOneDnn, kInterleaved };

// dst[p, j, 0:2] = (src[2p, j], src[2p + 1, j]) for the pairs p < k / 2 and columns j < n, dst rows of
// ld_dst pairs.
void interleave_row_pairs(const c10::BFloat16* src, int64_t ld_src, int64_t k, int64_t n, c10::BFloat16* dst,
                          int64_t ld_dst) {
  for (int64_t p = 0; p < k / 2; ++p) {
    const c10::BFloat16* even = src + 2 * p * ld_src;
    const c10::BFloat16* odd = even + ld_src;
    c10::BFloat16* pairs = dst + 2 * p * ld_dst;
    for (int64_t j = 0; j < n; ++j) {
      pairs[2 * j] = even[j];
      pairs[2 * j + 1] = odd[j];
    }
  }
}

void pack_panel(Bf16Packing packing, const c10::BFloat16* b, int64_t ld, int64_t k, int64_t n, c10::BFloat16* dst,
                int64_t ld_dst) {
  if (packing == Bf16Packing::kOneDnn) {
    at::native::cpublas::pack(k, n, ld, ld_dst, at::kBFloat16, at::kBFloat16, b, dst);
  } else {
    interleave_row_pairs(b, ld, k, n, dst, ld_dst);
  }
}

// One small product with distinct entries (a wrong layout or a missing kernel gives a wrong answer or
// throws), so that a CPU oneDNN misjudges keeps the widened route instead of failing inside attention.
bool products_work(Bf16Packing packing) {
  try {
    constexpr int64_t m = 2, k = 4, n = 16;
    std::vector<c10::BFloat16> a(m * k), b(k * n), packed(k * n);
    for (int64_t i = 0; i < m * k; ++i) {
      a[i] = c10::BFloat16(static_cast<float>(i % 5) - 2.0f);
    }
    for (int64_t i = 0; i < k * n; ++i) {
      b[i] = c10::BFloat16(static_cast<float>(i % 7) - 3.0f);
    }
    std::vector<float> c(m * n, 0.0f);
    pack_panel(packing, b.data(), n, k, n, packed.data(), n);
    at::native::cpublas::brgemm(m, n, k, k, n, n, false, a.data(), packed.data(), c.data(), /*is_vnni=*/true);
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        float expected = 0.0f;
        for (int64_t l = 0; l < k; ++l) {
          expected += static_cast<float>(a[i * k + l]) * static_cast<float>(b[l * n + j]);
        }
        if (c[i * n + j] != expected) {
          return false;
        }
      }
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

Bf16Packing bf16_packing() {
  static const Bf16Packing packing = [] {
    if (gemm_choice() != GemmChoice::kAuto) {
      return Bf16Packing::kNone;
    }
    if (at::native::cpublas::could_pack(at::kBFloat16)) {
      return products_work(Bf16Packing::kOneDnn) ? Bf16Packing::kOneDnn : Bf16Packing::kNone;
    }
    // Without the instructions oneDNN would emulate bf16, slower than widening.
    if (cpu_has_avx512_bf16() && products_work(Bf16Packing::kInterleaved)) {
      return Bf16Packing::kInterleaved;
    }
    return Bf16Packing::kNone;
  }();
  return packing;
}

} // namespace

bool bf16_dot_products() {
  return bf16_packing() != Bf16Packing::kNone;
}

std::string bf16_matmul_description() {
  switch (bf16_packing()) {
    case Bf16Packing::kOneDnn:
      return "bf16 dot products (oneDNN brgemm, packed by oneDNN)";
    case Bf16Packing::kInterleaved:
      return "bf16 dot products (oneDNN brgemm, row pairs interleaved here)";
    case Bf16Packing::kNone:
      break;
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
    pack_panel(bf16_packing(), b + begin, ld, k, width, packed_.data() + begin * k, panel_stride(width));
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
    pack_panel(bf16_packing(), tile_.data(), width, k_, width, packed_.data() + begin * k_, panel_stride(width));
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
