// Everything the vector headers depend on, included by each kernels_<isa>.cpp *before* it switches
// the compiler to its instruction set. Inline functions from these headers are then compiled for the
// baseline ISA in every translation unit, so whichever copy the linker keeps runs on any CPU; only
// the at::vec code (namespaced per ISA by CPU_CAPABILITY) and the kernels themselves get wide
// instructions.
#pragma once

#include "flush_subnormals.h"

#include <ATen/Dispatch.h>
#include <ATen/NumericUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <ATen/native/quantized/AffineQuantizerBase.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/Load.h>
#include <c10/util/TypeCast.h>
#include <c10/util/bit_cast.h>
#include <c10/util/complex.h>
#include <c10/util/copysign.h>
#include <c10/util/irange.h>
#include <c10/util/qint32.h>
#include <c10/util/qint8.h>
#include <c10/util/quint8.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#error "cpu_isa_prelude.h must be included before CPU_CAPABILITY_* is defined"
#endif
