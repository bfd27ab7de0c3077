// Keeps a translation unit's multiplies and adds separate: contracting a * b + c into one fused
// multiply-add rounds once instead of twice, and kernels that promise the bits of an unfused reference
// must round twice. GCC contracts even at::vec's intrinsics when FMA is enabled. Include first, so the
// setting covers every function the file compiles. No include guard: one use per translation unit.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif
