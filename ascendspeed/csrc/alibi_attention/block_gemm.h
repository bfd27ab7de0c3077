// Row-major block matmuls of the ALiBi flash attention kernels, of two kinds:
// * gemm_rows: C[m, n] = alpha * op(A)[m, k] op(B)[k, n] + beta * C, op(X) = X or X^T, in fp32 or
//   fp64 (fp32 for bf16 / fp16 inputs widened first) through MKL's BLAS, or at::addmm in builds
//   without it;
// * PackedBf16: bf16 x bf16 -> fp32 on CPUs with bf16 dot-product instructions (AMX, AVX512-BF16),
//   through oneDNN's batch-reduce GEMM as torch exports it (at::native::cpublas::brgemm, the kernel
//   torch's own CPU flash attention uses for bf16 with AMX), the right-hand operand packed by oneDNN
//   where it packs (AMX) and interleaved here where it does not (AVX512-BF16 alone).
// Compiled for the baseline ISA: the libraries pick their own kernels at run time.
// ASCENDSPEED_ALIBI_GEMM chooses: unset or "auto" (bf16 dot products for bf16 inputs where the CPU has
// them, MKL otherwise), "mkl" (bf16 widened to fp32 everywhere), "aten" (at::addmm, as builds without
// MKL run). Tests compare them.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ascendspeed::alibi_attention {

void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_rows(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

// dst[c, r] = dst_t(src[r, c]) for r < rows, c < cols (src rows src_ld apart, dst rows dst_ld apart), in
// tiles of 16 x 16 so that both sides stay in L1: the transposes of operands into packing order and of
// transposed accumulators back into rows.
template <typename src_t, typename dst_t>
inline void transpose_rows(const src_t* src, int64_t src_ld, int64_t rows, int64_t cols, dst_t* dst,
                           int64_t dst_ld) {
  constexpr int64_t kTile = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t r1 = rows < r0 + kTile ? rows : r0 + kTile;
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t c1 = cols < c0 + kTile ? cols : c0 + kTile;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          dst[c * dst_ld + r] = static_cast<dst_t>(src[r * src_ld + c]);
        }
      }
    }
  }
}

// Whether bf16 inputs multiply as bf16 (see above); the same answer for every call of a process.
bool bf16_dot_products();

// Whether the CPU has AVX512-BF16 (its fp32 -> bf16 conversion instructions).
bool cpu_has_avx512_bf16();

// "bf16 dot products (oneDNN brgemm, ...)" (saying who packs), "fp32 (MKL sgemm)" or "fp32 (at::addmm)":
// how the block matmuls of bf16 inputs run, for benchmarks and tests.
std::string bf16_matmul_description();

// A right-hand operand B[k, n] (k even) in the layout bf16 dot products read: pairs of rows
// interleaved (VNNI), in panels of up to kPanel columns (rows padded to a multiple of 16). Packed once,
// multiplied by many blocks.
class PackedBf16 {
 public:
  static constexpr int64_t kPanel = 64;

  // Packs row-major B[k, n] with leading dimension ld.
  void pack(const c10::BFloat16* b, int64_t ld, int64_t k, int64_t n);
  // Packs B = X^T for the row-major X[n, x_cols] (rows `stride` apart), k = x_cols rounded up to even
  // (a zero row added for odd x_cols).
  void pack_transposed(const c10::BFloat16* x, int64_t stride, int64_t n, int64_t x_cols);

  // C[m, columns] (+)= A[m, k] B[:, columns] for the columns [n_begin, n_end) of B, A row-major bf16
  // (lda), C fp32 (ldc, pointing at column n_begin of row 0). n_begin must start a panel.
  void multiply(const c10::BFloat16* a, int64_t lda, int64_t m, float* c, int64_t ldc, bool accumulate,
                int64_t n_begin, int64_t n_end) const;
  void multiply(const c10::BFloat16* a, int64_t lda, int64_t m, float* c, int64_t ldc, bool accumulate) const {
    multiply(a, lda, m, c, ldc, accumulate, 0, n_);
  }

  int64_t k() const { return k_; }

 private:
  // A packed panel's row length: oneDNN packs rows of 16, 32, 48 or 64 columns.
  static int64_t panel_stride(int64_t width) { return (width + 15) / 16 * 16; }

  std::vector<c10::BFloat16> packed_, tile_;
  int64_t k_ = 0, n_ = 0;
};

// Ends this thread's use of bf16 dot products (AMX keeps tile state per thread): call once after a
// thread's last PackedBf16::multiply.
void release_bf16_dot_products();

} // namespace ascendspeed::alibi_attention
