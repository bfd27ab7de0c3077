"""accelerator.gdn_fallback: fla's gated delta rule, L2 norm and convolution in torch where fla is absent.

The chunked rule is checked against the gated delta rule run token by token in float64, forward and backward,
on single sequences and packs; megatron-core's own ``GatedDeltaNet`` then builds and trains on the fallback.
"""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import megatron as mu  # installs ascendspeed (CPU shims) before megatron is used
from ascendspeed.accelerator import gdn_fallback
from ascendspeed.accelerator.gdn_fallback import kernels
from ascendspeed.patching.patch import installed_version
from ascendspeed.patching.versions import release

pytestmark = [pytest.mark.skipif(not gdn_fallback.needed(), reason="fla is installed"),
              pytest.mark.skipif(release(installed_version()) < release("0.18.0"),
                                 reason="megatron-core < 0.18 has no torch gated delta rule to serve fla's")]


def recurrence(q, k, v, g, beta):
    """The gated delta rule one token at a time (float64): decay the state, correct it towards v, read it."""
    batch, length, heads, key_dim = q.shape
    state = torch.zeros(batch, heads, key_dim, v.size(-1), dtype=q.dtype)
    outputs = []
    for t in range(length):
        state = state * torch.exp(g[:, t])[..., None, None]
        predicted = (state * k[:, t][..., None]).sum(-2)
        state = state + beta[:, t][..., None, None] * k[:, t][..., None] * (v[:, t] - predicted)[:, :, None, :]
        outputs.append((state * q[:, t][..., None]).sum(-2) * key_dim ** -0.5)
    return torch.stack(outputs, dim=1)


def sample_inputs(length, heads, key_dim, value_dim, seed):
    generator = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, dtype=torch.float64, generator=generator)

    q, k = (F.normalize(randn(1, length, heads, key_dim), dim=-1) for _ in range(2))
    return dict(q=q, k=k, v=randn(1, length, heads, value_dim),
                g=-torch.rand(1, length, heads, dtype=torch.float64, generator=generator),
                beta=torch.rand(1, length, heads, dtype=torch.float64, generator=generator))


@pytest.mark.parametrize("bounds", [None, [0, 20, 20, 70], [0, 1, 70]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_rule_equals_the_recurrence(bounds, dtype):
    inputs = sample_inputs(70, 2, 8, 4, seed=len(bounds or []))
    ours = {name: value.to(dtype).requires_grad_() for name, value in inputs.items()}
    out, final = kernels.chunk_gated_delta_rule(**ours, cu_seqlens=None if bounds is None else torch.tensor(bounds))
    assert final is None and out.dtype == dtype
    reference = {name: value.clone().requires_grad_() for name, value in inputs.items()}
    pieces = [(0, 70)] if bounds is None else list(zip(bounds[:-1], bounds[1:]))
    expected = torch.cat([recurrence(*(reference[n][:, a:e] for n in ("q", "k", "v", "g", "beta")))
                          for a, e in pieces if e > a], dim=1)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(out.double(), expected, **tolerance)
    cotangent = torch.randn(expected.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, list(ours.values()), cotangent.to(dtype))
    expected_grads = torch.autograd.grad(expected, list(reference.values()), cotangent)
    for name, grad, reference_grad in zip(ours, grads, expected_grads):
        torch.testing.assert_close(grad.double(), reference_grad, **tolerance, msg=name)


def test_l2norm_and_packed_convolution_keep_flas_contracts():
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(kernels.l2norm(x), x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt())
    tokens, weight = torch.randn(1, 9, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    packed, state = kernels.causal_conv1d(tokens, weight, activation="silu", cu_seqlens=torch.tensor([0, 4, 9]))
    alone = torch.cat([kernels.causal_conv1d(tokens[:, a:e], weight, activation="silu")[0] for a, e in ((0, 4), (4, 9))],
                      dim=1)
    assert state is None
    torch.testing.assert_close(packed, alone, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="convolution states"):
        kernels.causal_conv1d(tokens, weight, output_final_state=True)


def test_megatron_gated_delta_net_builds_and_trains_on_the_fallback():
    """megatron-core's GatedDeltaNet layer from its hybrid stack spec: it raised "FLA is not installed"; it builds
    and a few Adam steps lower a regression loss."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    with mu.one_process_world():
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                   linear_conv_kernel_dim=4, use_cpu_initialization=True, hidden_dropout=0.0,
                                   bias_dropout_fusion=False, activation_func=F.silu)  # GDN's convolution: SiLU
        layer = build_module(hybrid_stack_spec.submodules.gdn_layer, config=config, layer_number=1,
                             pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        generator = torch.Generator().manual_seed(0)
        hidden, target = torch.randn(24, 2, 32, generator=generator), torch.randn(24, 2, 32, generator=generator)
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            output = layer(hidden, attention_mask=None)
            loss = F.mse_loss(output[0] if isinstance(output, tuple) else output, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
        assert losses[-1] < losses[0], losses
