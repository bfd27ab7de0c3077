// Rotary position embedding as torch operators, with the semantics of Megatron's
// _apply_rotary_pos_emb_bshd (megatron/core/models/common/embeddings/rope_utils.py, mscale 1):
//   ascendspeed::rotary_embedding(t, freqs, interleaved) -> out
//     t [s, b, h, d], freqs [s, 1, 1, d_rot] (angles): the first d_rot features of t rotated by the
//     angles, t * cos(freqs) + rotate_half(t) * sin(freqs), the other d - d_rot features passed through;
//   ascendspeed::rotary_embedding_backward(grad_out, freqs, interleaved) -> grad_t
//     the transpose of that linear map (the rotation by -freqs for Megatron's paired angles): it needs
//     only freqs, so autograd saves nothing of the size of t.
//
// This file owns the schemas, the argument checks (one function, used by the CPU and the Meta kernels
// of both operators) and the choice of CPU kernel; the kernels are in rotary_kernels_impl.h. Autograd
// and the CUDA / NPU kernels are registered from Python by ascendspeed/ops/rotary.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <string>

#include "../common/cpu_isa.h"
#include "rotary_kernels.h"

namespace ascendspeed::rotary {
namespace {

bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble;
}

// Every rejection of the arguments of rotary_embedding (op = "rotary_embedding", t named "t") and of
// rotary_embedding_backward (t named "grad_out"). Called by the CPU and Meta kernels of both.
void check_arguments(const char* op, const char* t_name, const at::Tensor& t, const at::Tensor& freqs) {
  TORCH_CHECK_VALUE(
      t.dim() == 4,
      op,
      ": ",
      t_name,
      " must be 4-D [seq, batch, heads, head_dim] (Megatron's bshd layout), got shape ",
      t.sizes());
  TORCH_CHECK_TYPE(
      is_supported_float(t.scalar_type()),
      op,
      ": ",
      t_name,
      " must be float32, bfloat16, float16 or float64, got ",
      t.scalar_type());
  TORCH_CHECK_VALUE(
      freqs.dim() == 4 && freqs.size(0) == t.size(0) && freqs.size(1) == 1 && freqs.size(2) == 1,
      op,
      ": freqs must have shape [seq, 1, 1, d_rot] with seq = ",
      t_name,
      ".size(0) = ",
      t.size(0),
      " (slice Megatron's rotary embedding to the sequence), got shape ",
      freqs.sizes());
  const int64_t d_rot = freqs.size(3);
  TORCH_CHECK_VALUE(
      d_rot > 0 && d_rot % 2 == 0 && d_rot <= t.size(3),
      op,
      ": freqs.size(-1) (the rotated features, d_rot) must be even, positive and at most ",
      t_name,
      ".size(-1) = ",
      t.size(3),
      ", got ",
      d_rot);
  TORCH_CHECK_TYPE(
      is_supported_float(freqs.scalar_type()),
      op,
      ": freqs must be float32, bfloat16, float16 or float64, got ",
      freqs.scalar_type());
  TORCH_CHECK(
      freqs.device() == t.device(),
      op,
      ": freqs must be on the device of ",
      t_name,
      " (",
      t.device(),
      "), got ",
      freqs.device(),
      "; move it with freqs.to(",
      t_name,
      ".device)");
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels& chosen =
      cpu::widest_kernels(cpu_kernels_avx512(), cpu_kernels_avx2(), cpu_kernels_default());
  return chosen;
}

// t is read where it lies when its features are contiguous (Megatron's query and key are often
// strided views of the fused QKV projection); anything else is copied once.
at::Tensor apply_cpu(const at::Tensor& t, const at::Tensor& freqs, bool interleaved, bool transpose) {
  const at::Tensor input = t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous();
  auto out = cpu::empty_output(t.sizes(), t.options());
  if (out.numel() > 0) {
    const auto angles = freqs.reshape({freqs.size(0), freqs.size(3)})
                            .to(at::toOpMathType(t.scalar_type()))
                            .contiguous();
    cpu_kernels().apply(input, angles, interleaved, transpose, out);
  }
  return out;
}

at::Tensor rotary_embedding_cpu(const at::Tensor& t, const at::Tensor& freqs, bool interleaved) {
  check_arguments("rotary_embedding", "t", t, freqs);
  return apply_cpu(t, freqs, interleaved, /*transpose=*/false);
}

at::Tensor rotary_embedding_backward_cpu(const at::Tensor& grad_out, const at::Tensor& freqs, bool interleaved) {
  check_arguments("rotary_embedding_backward", "grad_out", grad_out, freqs);
  return apply_cpu(grad_out, freqs, interleaved, /*transpose=*/true);
}

// Shapes, dtypes and strides only: what FakeTensor and torch.compile see.
at::Tensor rotary_embedding_meta(const at::Tensor& t, const at::Tensor& freqs, bool interleaved) {
  check_arguments("rotary_embedding", "t", t, freqs);
  return at::empty(t.sizes(), t.options());
}

at::Tensor rotary_embedding_backward_meta(const at::Tensor& grad_out, const at::Tensor& freqs, bool interleaved) {
  check_arguments("rotary_embedding_backward", "grad_out", grad_out, freqs);
  return at::empty(grad_out.sizes(), grad_out.options());
}

std::string cpu_kernel() {
  return cpu::describe_kernels(cpu_kernels().isa);
}

} // namespace
} // namespace ascendspeed::rotary

TORCH_LIBRARY_FRAGMENT(ascendspeed, m) {
  m.set_python_module("ascendspeed.ops.rotary");
  m.def("rotary_embedding(Tensor t, Tensor freqs, bool interleaved=False) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def(
      "rotary_embedding_backward(Tensor grad_out, Tensor freqs, bool interleaved=False) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def("_rotary_embedding_cpu_kernel() -> str", &ascendspeed::rotary::cpu_kernel);
}

TORCH_LIBRARY_IMPL(ascendspeed, CPU, m) {
  m.impl("rotary_embedding", &ascendspeed::rotary::rotary_embedding_cpu);
  m.impl("rotary_embedding_backward", &ascendspeed::rotary::rotary_embedding_backward_cpu);
}

TORCH_LIBRARY_IMPL(ascendspeed, Meta, m) {
  m.impl("rotary_embedding", &ascendspeed::rotary::rotary_embedding_meta);
  m.impl("rotary_embedding_backward", &ascendspeed::rotary::rotary_embedding_backward_meta);
}
