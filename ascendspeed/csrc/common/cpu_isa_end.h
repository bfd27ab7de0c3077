// Ends the instruction-set region opened by cpu_isa_avx2_begin.h or cpu_isa_avx512_begin.h.
#pragma GCC pop_options
