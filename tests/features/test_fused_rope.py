"""``--use-fused-rotary-pos-emb`` on every path of megatron-core's ``_apply_rotary_pos_emb_bshd``, multi-latent
attention's (de-interleaved features, YaRN's ``mscale``) included: the wrapped function against megatron-core's
own, forward and backward, float64 / fp32 / bf16, with the fused operator counted."""
import pytest
import torch

from tests.helpers import megatron as mu  # noqa: F401  installs ascendspeed (CPU shims) before megatron is used
from megatron.core.models.common.embeddings import rope_utils

from ascendspeed.features import disable_features, enable_features

#: (dtype, relative tolerance of output and gradient): float64 and fp32 to rounding; in bf16 Megatron rounds
#: ``cos * mscale`` to bf16 before multiplying, the operator computes in fp32 and rounds once.
DTYPES = [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 2e-2)]
#: (name, head dim, rotated features, rotary_interleaved, mla_rotary_interleaved, mscale)
PATHS = [
    ("gpt", 16, 16, False, False, 1.0),
    ("gpt partial rotary", 24, 16, False, False, 1.0),
    ("gpt interleaved", 16, 16, True, False, 1.0),
    ("mla yarn", 8, 8, False, True, 1.3687),
    ("mla mscale 1", 8, 8, False, True, 1.0),
    ("mla with pass-through", 12, 8, False, True, 0.8),
]


@pytest.fixture(scope="module")
def fused_and_megatron():
    enable_features(position_embedding_type="rope", use_fused_rotary_pos_emb=True)
    fused = rope_utils._apply_rotary_pos_emb_bshd
    yield fused, fused.__wrapped__
    disable_features()


def _yarn_like_freqs(seq: int, rotated: int) -> torch.Tensor:
    """Megatron's [s, 1, 1, d_rot] angle layout (each half repeats the frequencies), uneven frequencies."""
    inverse = torch.rand(rotated // 2, dtype=torch.float64) * 0.5 + 1e-3
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inverse[None, :]
    return torch.cat((angles, angles), dim=-1).float()[:, None, None, :]


@pytest.mark.parametrize("dtype, tolerance", DTYPES, ids=str)
@pytest.mark.parametrize("name, head_dim, rotated, interleaved, mla, mscale", PATHS, ids=[p[0] for p in PATHS])
def test_the_fused_path_equals_megatron_s_forward_and_backward(fused_and_megatron, dtype, tolerance, name, head_dim,
                                                               rotated, interleaved, mla, mscale):
    fused, megatron = fused_and_megatron
    seq, batch, heads = 11, 2, 3
    freqs = _yarn_like_freqs(seq, rotated)
    if interleaved:
        freqs = freqs[..., : rotated // 2].repeat_interleave(2, dim=-1)
    t = torch.randn(seq, batch, heads, head_dim, dtype=torch.float64)
    grad = torch.randn_like(t)
    expected_input = t.clone().requires_grad_()
    expected = megatron(expected_input, freqs.double(), interleaved, mla, mscale)
    expected.backward(grad)
    actual_input = t.to(dtype).requires_grad_()
    with torch.autograd.profiler.profile() as profile:
        actual = fused(actual_input, freqs, interleaved, mla, mscale)  # 0.15-0.18 name the 4th multi_latent_attention
        actual.backward(grad.to(dtype))
    assert sum(event.name == "ascendspeed::rotary_embedding_backward" for event in profile.function_events) == 1
    assert actual.dtype == dtype and actual.shape == expected.shape
    for got, want in ((actual, expected), (actual_input.grad, expected_input.grad)):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error <= tolerance, f"{name} {dtype}: relative error {error:.2e}"
