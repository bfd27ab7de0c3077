// The contract between the MoE permutation operators (moe_permute.cpp) and their row kernels.
//
// The kernels are compiled once per instruction set (kernels_default.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp); the operators pick the widest one that torch itself uses on this CPU. Every kernel
// sees its tokens and rows as contiguous rows of `width` elements, and works token by token over the
// token's rows in ascending order (RowsOfTokens), so each token's row is read or written once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ascendspeed::moe_permute {

// For every token, its rows in ascending order: rows of token t are rows[start[t] .. start[t + 1]).
struct RowsOfTokens {
  std::vector<int64_t> start;
  std::vector<int64_t> rows;
};

struct CpuKernels {
  // out[r] = x[t] for every row r of token t; with row_probs (defined: one scalar per row, in the dtype
  // products are taken in), out[r] = x[t] * row_probs[r], rounded in that dtype, then to out's.
  void (*gather_rows)(
      const at::Tensor& x, const at::Tensor& row_probs, const RowsOfTokens& index, const at::Tensor& out);
  // out[t] = sum over the rows r of token t, ascending, from zero, of y[r] (* row_probs[r], the product
  // rounded in row_probs' dtype), summed in that dtype's opmath type and rounded to out's dtype once.
  void (*scatter_add_rows)(
      const at::Tensor& y, const at::Tensor& row_probs, const RowsOfTokens& index, const at::Tensor& out);
  const char* isa;
};

// nullptr when this build has no kernels for that instruction set (another compiler or CPU family).
const CpuKernels* cpu_kernels_default();
const CpuKernels* cpu_kernels_avx2();
const CpuKernels* cpu_kernels_avx512();

}  // namespace ascendspeed::moe_permute
