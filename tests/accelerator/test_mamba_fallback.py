"""accelerator.mamba_fallback: Mamba-2's kernels in torch where mamba_ssm / causal_conv1d are absent.

The chunked scan is checked against the plain recurrence run token by token in float64 (a different
formulation), the convolution against torch's ``conv1d``, forward and backward, on fresh random inputs;
megatron-core's own ``MambaMixer`` then builds and trains on them.
"""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import megatron as mu  # installs ascendspeed (CPU shims) before megatron is used
from ascendspeed.accelerator import mamba_fallback
from ascendspeed.accelerator.mamba_fallback import decode, ssd

pytestmark = pytest.mark.skipif(not mamba_fallback.needed(), reason="mamba_ssm is installed")

#: (batch, length, heads, headdim, groups, d_state, chunk_size): chunks that do and do not divide the length
SHAPES = [(2, 37, 4, 3, 2, 5, 8), (1, 16, 2, 4, 1, 3, 16), (2, 50, 6, 2, 3, 4, 7), (1, 5, 2, 2, 2, 2, 64)]
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-4),
             torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def sample_inputs(shape, dtype, seed, packed=False):
    batch, length, heads, headdim, groups, d_state, _ = shape
    generator = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, dtype=torch.float64, generator=generator)

    inputs = dict(x=randn(batch, length, heads, headdim), dt=randn(batch, length, heads),
                  A=-2 * torch.rand(heads, dtype=torch.float64, generator=generator),
                  B=randn(batch, length, groups, d_state), C=randn(batch, length, groups, d_state),
                  D=randn(heads) if seed % 2 else randn(heads, headdim), z=randn(batch, length, heads, headdim),
                  dt_bias=randn(heads), initial_states=None if packed else randn(batch, heads, headdim, d_state))
    seq_idx = torch.sort(torch.randint(0, 4, (batch, length), generator=generator), dim=1).values if packed else None
    floating = {k: (v if k in ("A", "dt_bias") or v is None else v.to(dtype)) for k, v in inputs.items()}
    return floating, seq_idx


def recurrence(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
    """Mamba-2's state-space recurrence, one token at a time (float64); ``z`` None: no gate."""
    batch, length, heads, headdim = x.shape
    dt = F.softplus(dt + dt_bias)
    B, C = (t.repeat_interleave(heads // t.size(2), dim=2) for t in (B, C))
    state = (torch.zeros(batch, heads, headdim, B.size(-1), dtype=x.dtype) if initial_states is None
             else initial_states)
    outputs = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)
        if seq_idx is not None and t > 0:
            decay = decay * (seq_idx[:, t] == seq_idx[:, t - 1]).to(x.dtype)[:, None]
        state = decay[..., None, None] * state + dt[:, t][..., None, None] * x[:, t][..., None] * B[:, t][:, :, None]
        skip = D[:, None] if D.dim() == 1 else D
        outputs.append((state * C[:, t][:, :, None]).sum(-1) + x[:, t] * skip)
    y = torch.stack(outputs, dim=1)
    return (y if z is None else y * F.silu(z)), state


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_chunk_scan_equals_the_recurrence(shape, dtype, packed):
    inputs, seq_idx = sample_inputs(shape, dtype, seed=hash((shape, packed)) % 1000, packed=packed)
    names = [name for name, value in inputs.items() if value is not None]
    ours = {name: inputs[name].clone().requires_grad_() for name in names}
    out, final = ssd.chunk_scan(ours["x"], ours["dt"], ours["A"], ours["B"], ours["C"], shape[-1], D=ours["D"],
                                z=ours["z"], dt_bias=ours["dt_bias"], initial_states=ours.get("initial_states"),
                                seq_idx=seq_idx, dt_softplus=True)
    reference = {name: inputs[name].double().clone().requires_grad_() for name in names}
    expected, expected_final = recurrence(*(reference.get(n) for n in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias",
                                                                     "initial_states")), seq_idx)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])
    torch.testing.assert_close(final.double(), expected_final, **TOLERANCE[dtype])
    cotangent = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, [ours[n] for n in names], cotangent.to(dtype))
    expected_grads = torch.autograd.grad(expected, [reference[n] for n in names], cotangent)
    for name, grad, reference_grad in zip(names, grads, expected_grads):
        scale = max(1.0, reference_grad.abs().max().item())
        torch.testing.assert_close(grad.double() / scale, reference_grad / scale, **TOLERANCE[dtype], msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_equals_torch_conv1d_per_sequence(dtype, width):
    """A packed row equals each of its sequences convolved alone with torch's conv1d (zero left padding)."""
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(2, 19, 6, dtype=torch.float64, generator=generator)
    weight, bias = torch.randn(6, width, dtype=torch.float64, generator=generator), torch.randn(6, dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 7 + [1] * 1 + [2] * 11, [0] * 19])
    ours = [t.to(dtype).requires_grad_() for t in (x, weight, bias)]
    out = ssd.causal_conv1d(*ours, seq_idx=seq_idx, activation="silu")
    reference = [t.clone().requires_grad_() for t in (x, weight, bias)]
    pieces = []
    for row in range(2):
        for sequence in seq_idx[row].unique():
            tokens = reference[0][row, seq_idx[row] == sequence].T[None]   # [1, channels, tokens]
            convolved = F.conv1d(tokens, reference[1][:, None], reference[2], padding=width - 1, groups=6)
            pieces.append(F.silu(convolved[0, :, :tokens.size(-1)].T))
    expected = torch.cat(pieces).view(2, 19, 6)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])
    cotangent = torch.randn(expected.shape, dtype=torch.float64)
    for grad, reference_grad in zip(torch.autograd.grad(out, ours, cotangent.to(dtype)),
                                    torch.autograd.grad(expected, reference, cotangent)):
        torch.testing.assert_close(grad.double(), reference_grad, **TOLERANCE[dtype])


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_split_conv1d_scan_combined_composes_the_pieces(norm_before_gate):
    """mamba_ssm's training kernel: split, convolve, scan, gated RMSNorm by groups, output projection."""
    generator = torch.Generator().manual_seed(3)
    heads, headdim, groups, d_state, width = 4, 3, 2, 5, 4
    dim, conv_dim = heads * headdim, heads * headdim + 2 * groups * d_state

    def randn(*size):
        return torch.randn(*size, dtype=torch.float64, generator=generator)

    zxbcdt = randn(2, 21, 2 * dim + 2 * groups * d_state + heads)
    weight, bias, dt_bias, D = randn(conv_dim, width), randn(conv_dim), randn(heads), randn(heads)
    A = -torch.rand(heads, dtype=torch.float64, generator=generator)
    norm_weight, projection = randn(dim), randn(7, dim)
    out = ssd.mamba_split_conv1d_scan_combined(zxbcdt, weight, bias, dt_bias, A, D, 8, headdim=headdim, ngroups=groups,
                                               rmsnorm_weight=norm_weight, rmsnorm_eps=1e-5, outproj_weight=projection,
                                               norm_before_gate=norm_before_gate)
    z, xBC, dt = zxbcdt.split([dim, conv_dim, heads], dim=-1)
    convolved = ssd.causal_conv1d(xBC, weight, bias, activation="silu")
    x, B, C = convolved.split([dim, groups * d_state, groups * d_state], dim=-1)
    y, _ = recurrence(x.view(2, 21, heads, headdim), dt, A, B.view(2, 21, groups, d_state),
                      C.view(2, 21, groups, d_state), D, None, dt_bias, None, None)
    y = y.reshape(2, 21, dim)
    gate = F.silu(z)
    grouped = (y if norm_before_gate else y * gate).view(2, 21, groups, dim // groups)
    normed = (grouped / (grouped.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()).reshape(2, 21, dim) * norm_weight
    expected = (normed * gate if norm_before_gate else normed) @ projection.T
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_megatron_mamba_mixer_builds_and_trains_on_the_fallback():
    """megatron-core's MambaLayer from its hybrid stack spec (Transformer Engine's classes on the TE fallback):
    the mixer builds where it raised "MambaSSM is not installed", and a few Adam steps lower a regression loss."""
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.transformer_config import TransformerConfig

    with mu.one_process_world():
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, mamba_state_dim=8,
                                   mamba_head_dim=8, mamba_num_groups=2, use_cpu_initialization=True,
                                   hidden_dropout=0.0, bias_dropout_fusion=False, params_dtype=torch.float32)
        layer = _mamba_layer(config)
        assert isinstance(layer.mixer, MambaMixer)
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(24, 2, 32, generator=generator)
        target = torch.randn(24, 2, 32, generator=generator)
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            output = layer(hidden, attention_mask=None)
            output = output[0] if isinstance(output, tuple) else output
            loss = F.mse_loss(output, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
        assert losses[-1] < losses[0], losses


def _mamba_layer(config):
    import inspect

    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.spec_utils import build_module

    try:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as stack_spec
    except ImportError:   # before HybridModel (0.18): the Mamba stack spec
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as stack_spec
    groups = {}
    if "pg_collection" in inspect.signature(MambaLayer.__init__).parameters:
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups["pg_collection"] = ProcessGroupCollection.use_mpu_process_groups()
    return build_module(stack_spec.submodules.mamba_layer, config=config, layer_number=1, **groups)


#: decode steps of 1 and several tokens (speculative drafts), for a sequence of 11
STEPS = (1, 3, 1, 2, 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_len", [4, 6])
def test_causal_conv1d_update_steps_through_the_convolution(dtype, state_len):
    """Token by token (and several at a time) from a zero state, the convolution state update gives the whole
    sequence's causal convolution; each batch entry uses its slot, a negative slot is padding (zero output,
    no state touched), and the intermediate states are the last ``state_len`` inputs after every token."""
    generator = torch.Generator().manual_seed(state_len)
    batch, length, channels, width = 3, sum(STEPS), 5, 4
    x = torch.randn(batch, length, channels, dtype=torch.float64, generator=generator).to(dtype)
    weight = torch.randn(channels, width, dtype=torch.float64, generator=generator).to(dtype)
    bias = torch.randn(channels, dtype=torch.float64, generator=generator).to(dtype)
    expected = ssd.causal_conv1d(x.double(), weight.double(), bias.double(), activation="silu")
    slots = torch.tensor([2, -1, 0])
    conv_state = torch.zeros(4, channels, state_len, dtype=dtype)
    conv_state[3] = 7.0  # a slot nobody uses
    start = 0
    for size in STEPS:
        chunk = x[:, start:start + size]
        intermediate = torch.zeros(4, size, channels, state_len, dtype=dtype)
        out = decode.causal_conv1d_update(chunk.squeeze(1) if size == 1 else chunk, conv_state, weight, bias, "silu",
                                          slots, intermediate_conv_states=intermediate)
        out = out.unsqueeze(1) if size == 1 else out
        for entry, slot in ((0, 2), (2, 0)):
            torch.testing.assert_close(out[entry].double(), expected[entry, start:start + size], **TOLERANCE[dtype])
            history = F.pad(x[entry, :start + size].T, (state_len, 0))
            for step in range(size):
                end = start + step + 1 + state_len
                assert torch.equal(intermediate[slot, step], history[:, end - state_len:end])
            assert torch.equal(conv_state[slot], history[:, -state_len:])
        assert not out[1].any()
        start += size
    assert not conv_state[1].any() and (conv_state[3] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_selective_state_update_steps_through_the_recurrence(shape, dtype):
    """megatron-core's decode call (dt, dt_bias and D per head and channel, A expanded over the channels): step by
    step from an initial state, every output and the state after every token equal the recurrence."""
    inputs, _ = sample_inputs(shape, torch.float64, seed=sum(shape))
    batch, length, heads, headdim, groups, d_state, _ = shape
    length = min(length, sum(STEPS))
    expected, _ = recurrence(*(inputs[n][:, :length] if n in ("x", "dt", "B", "C", "z") else inputs[n]
                               for n in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")), None)
    slots = torch.randperm(batch + 1, generator=torch.Generator().manual_seed(1))[:batch]
    state = torch.zeros(batch + 1, heads, headdim, d_state, dtype=dtype)
    state[slots] = inputs["initial_states"].to(dtype)
    A = inputs["A"].to(dtype).view(-1, 1, 1).expand(heads, headdim, d_state)
    dt_bias = inputs["dt_bias"][:, None].expand(heads, headdim)
    D = inputs["D"][:, None].expand(heads, headdim) if inputs["D"].dim() == 1 else inputs["D"]
    start, outputs = 0, []
    while start < length:
        size = min(STEPS[len(outputs) % len(STEPS)], length - start)
        piece = {n: inputs[n][:, start:start + size].to(dtype) for n in ("x", "B", "C", "z")}
        dt = inputs["dt"][:, start:start + size, :, None].expand(-1, -1, -1, headdim).to(dtype)
        intermediate = torch.zeros(batch + 1, size, heads, headdim, d_state, dtype=dtype)
        outputs.append(decode.selective_state_update(state, piece["x"], dt, A, piece["B"], piece["C"], D,
                                                     z=piece["z"], dt_bias=dt_bias, dt_softplus=True,
                                                     state_batch_indices=slots, intermediate_ssm_states=intermediate))
        start += size
        _, after = recurrence(*(inputs[n][:, :start] if n in ("x", "dt", "B", "C", "z") else inputs[n]
                                for n in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")), None)
        torch.testing.assert_close(intermediate[slots, -1].double(), after, **TOLERANCE[dtype])
        torch.testing.assert_close(state[slots].double(), after, **TOLERANCE[dtype])
    torch.testing.assert_close(torch.cat(outputs, dim=1).double(), expected, **TOLERANCE[dtype])


def test_megatron_mamba_mixer_decodes_token_by_token_as_it_runs_the_sequence():
    """Static-batching inference through megatron-core's MambaMixer: a prefill of the prompt, then one decode
    step per token (megatron-core's conv and SSM steps, torch here), gives the outputs the whole sequence gets.
    One sequence: from 0.17 megatron-core's static decode hands its [1, batch, d] projection to the step
    kernels as one sequence of ``batch`` tokens, which only a batch of one survives (on CUDA as well)."""
    import contextlib

    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        from megatron.core.inference.utils import InferenceMode
        inference_mode = InferenceMode.active
    except ImportError:   # before 0.19: inference is a context outside training mode
        inference_mode = contextlib.nullcontext

    with mu.one_process_world():
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, mamba_state_dim=8,
                                   mamba_head_dim=8, mamba_num_groups=2, use_cpu_initialization=True,
                                   hidden_dropout=0.0, bias_dropout_fusion=False, params_dtype=torch.float32)
        mixer = _mamba_layer(config).mixer.eval()
        generator = torch.Generator().manual_seed(5)
        length, prompt = 13, 5
        hidden = torch.randn(length, 1, 32, generator=generator)
        with torch.no_grad():
            whole, _ = mixer(hidden)
            context = StaticInferenceContext(max_batch_size=1, max_sequence_length=length)
            outputs = []
            with inference_mode():
                for start, end in [(0, prompt)] + [(t, t + 1) for t in range(prompt, length)]:
                    context.seqlen_offset = context.sequence_len_offset   # what megatron-core's Mamba stack sets
                    out, _ = mixer(hidden[start:end], inference_context=context)
                    outputs.append(out)
                    context.sequence_len_offset += end - start
    torch.testing.assert_close(torch.cat(outputs), whole, rtol=1e-5, atol=1e-5)
