"""Tensor-parallel communication over computation (``--use-ascend-coc``) on two gloo ranks.

One job serves every case. The four chunked linears are checked against a float64 reference of the whole
(unsharded) layer, forward and backward, in fp32 and bf16, on shapes whose sequence does and does not divide
into the chunks (and has fewer rows than chunks), and against megatron-core's own unchunked linear in the
same dtype (fp32: 1e-6; not always to the bit: the BLAS blocks a GEMM of fewer rows differently, and a weight
gradient summed over chunks adds in another order); in bf16 and fp16 with ``fp32_products`` (CPUs without a
fast half-precision GEMM), only fp32 products, compared bit for bit with the fp32 kernel rounded once. Then a
tiny GPT with TP2, with and without sequence parallelism, local and TE spec, trains one step with CoC at every
``--coc-parallel-num`` and matches plain TP2 in loss and every gradient (1e-6), while the telemetry counts the
collectives the chunks issued; a bf16 one with the fp32 products matches plain TP2 in bf16. Last, full
recompute with TP2 + SP and dropout at ``--optimize-recomp-communication-level`` 1 and 2, with and without CoC,
gives plain full recompute's losses and gradients, and the counted collectives drop by exactly the ones each
level leaves out.
"""
import argparse

import pytest
import torch

from ascendspeed.features import FeatureArgumentError, all_features, applied_features, disable_features
from ascendspeed.features import enable_features
from tests.helpers.distributed import run_distributed

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
CHUNKS = (1, 2, 4, 8)
#: (rows of the sequence per rank, batch, input features, output features); 3 rows: fewer than 4 and 8 chunks.
SHAPES = ((8, 2, 16, 24), (7, 3, 32, 8), (3, 1, 8, 16))
KINDS = ("column_sp", "row_sp", "row", "column")


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _global_inputs(kind, shape, world, dtype, seed):
    """The whole layer's input, weight, bias and output gradient (the same on every rank), float64."""
    rows, batch, features_in, features_out = shape
    generator = torch.Generator().manual_seed(seed)
    sequence = rows * world
    return {
        "x": torch.randn(sequence, batch, features_in * (world if kind.startswith("row") else 1),
                         generator=generator, dtype=torch.float64).to(dtype).double(),
        "w": torch.randn(features_out * (1 if kind.startswith("row") else world),
                         features_in * (world if kind.startswith("row") else 1),
                         generator=generator, dtype=torch.float64).to(dtype).double() * 0.3,
        "b": torch.randn(features_out * world, generator=generator, dtype=torch.float64).to(dtype).double(),
        "g": torch.randn(sequence, batch, features_out * (1 if kind.startswith("row") else world),
                         generator=generator, dtype=torch.float64).to(dtype).double(),
    }


def _local_problem(kind, full, rank, world, rows):
    """This rank's input, weight, bias and output gradient, and the float64 reference of what it must get."""
    x, w, g = full["x"], full["w"], full["g"]
    mine = slice(rank * rows, (rank + 1) * rows)
    if kind.startswith("column"):
        width = w.size(0) // world
        cols = slice(rank * width, (rank + 1) * width)
        w_local, b_local, g_cols = w[cols], full["b"][cols], g[..., cols]
        x_local = x[mine] if kind == "column_sp" else x
        out = x @ w_local.t() + b_local
        grad_x = g @ w if kind == "column" else (g @ w)[mine]
        return dict(x=x_local, w=w_local, b=b_local, g=g_cols, out=out, grad_x=grad_x,
                    grad_w=g_cols.reshape(-1, width).t() @ x.reshape(-1, x.size(-1)), grad_b=g_cols.sum((0, 1)))
    width = w.size(1) // world
    cols = slice(rank * width, (rank + 1) * width)
    x_cols, w_local = x[..., cols], w[:, cols]
    out = x @ w.t()
    if kind == "row_sp":
        return dict(x=x_cols, w=w_local, b=None, g=g[mine], out=out[mine], grad_x=(g @ w)[..., cols],
                    grad_w=g.reshape(-1, g.size(-1)).t() @ x_cols.reshape(-1, width))
    return dict(x=x_cols, w=w_local, b=None, g=g, out=out, grad_x=g @ w_local,
                grad_w=g.reshape(-1, g.size(-1)).t() @ x_cols.reshape(-1, width))


def _run_chunked(kind, problem, dtype, chunks, group, fp32_products=False):
    from ascendspeed.features.tp_comm_overlap import chunked

    x = problem["x"].to(dtype).requires_grad_()
    w = problem["w"].to(dtype).requires_grad_()
    b = problem["b"].to(dtype).requires_grad_() if problem["b"] is not None else None
    if kind == "column_sp":
        out = chunked.AllGatherMatmul.apply(x, w, b, group, chunks, None, False, fp32_products)
    elif kind == "column":
        out = chunked.MatmulAllReduceInputGrad.apply(x, w, b, group, chunks, None, fp32_products)
    elif kind == "row_sp":
        out = chunked.MatmulReduceScatter.apply(x, w, group, chunks, None, fp32_products)
    else:
        out = chunked.MatmulAllReduce.apply(x, w, group, chunks, None, fp32_products)
    out.backward(problem["g"].to(dtype))
    return out.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def _run_megatron(kind, problem, dtype, process_group):
    """megatron-core's unchunked linear and collectives on the same inputs."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    x = problem["x"].to(dtype).requires_grad_()
    w = problem["w"].to(dtype).requires_grad_()
    b = problem["b"].to(dtype).requires_grad_() if problem["b"] is not None else None
    if kind.startswith("column"):
        out = linear_with_grad_accumulation_and_async_allreduce(
            x, w, b, gradient_accumulation_fusion=False, allreduce_dgrad=kind == "column",
            sequence_parallel=kind == "column_sp", tp_group=process_group)
    else:
        partial = torch.matmul(x, w.t())
        out = (mappings.reduce_scatter_to_sequence_parallel_region(partial, group=process_group)
               if kind == "row_sp" else mappings.reduce_from_tensor_model_parallel_region(partial, group=process_group))
    out.backward(problem["g"].to(dtype))
    return out.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def _operator_cases(rank, world):
    from ascendspeed.features.tp_comm_overlap.collectives import TpGroup
    from ascendspeed.features.tp_comm_overlap.telemetry import TpCommRecorder

    from megatron.core import parallel_state

    from tests.helpers import megatron as mu

    mu.initialize_parallel(tp=world)  # megatron-core's sequence-parallel linear gathers into its global buffer
    process_group = parallel_state.get_tensor_model_parallel_group()
    results = {}
    seed = 0
    for kind in KINDS:
        for shape in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                seed += 1
                full = _global_inputs(kind, shape, world, dtype, seed)
                problem = _local_problem(kind, full, rank, world, shape[0])
                expected = (problem["out"], problem["grad_x"], problem["grad_w"], problem.get("grad_b"))
                megatron = _run_megatron(kind, problem, dtype, process_group)
                for chunks in CHUNKS:
                    recorder = TpCommRecorder()
                    found = _run_chunked(kind, problem, dtype, chunks, TpGroup.of(process_group, recorder))
                    names = ("output", "input grad", "weight grad", "bias grad")
                    results[(kind, shape, str(dtype), chunks)] = {
                        "error": {name: _relative(a, e) for name, a, e in zip(names, found, expected) if e is not None},
                        "megatron_error": {name: _relative(a, e) for name, a, e in zip(names, megatron, expected)
                                           if e is not None},
                        "vs_megatron": {name: _relative(a, m) for name, a, m in zip(names, found, megatron)
                                        if m is not None},
                        "collectives": recorder.take().collectives,
                    }
    mu.destroy_parallel()
    return results


HALF_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
#: what no collective sums after the rounding, so equal to the fp32 kernel's result rounded once, per kind
ROUNDED_ONCE = {"column_sp": ("output", "weight grad"), "column": ("output", "weight grad"),
                "row_sp": ("input grad", "weight grad"), "row": ("input grad", "weight grad")}


def gemm_operand_dtypes(profile) -> list:
    """The dtypes of the matrix operands of every aten::mm / addmm / bmm the profile recorded."""
    return sorted({dtype for event in profile.events() if event.name in ("aten::mm", "aten::addmm", "aten::bmm")
                   for dtype in event.input_dtypes if dtype})


def _half_precision_cases(rank, world):
    """Each chunked linear in bf16 and fp16 with ``fp32_products`` (a CPU without a fast GEMM for the dtype):
    the GEMM operand dtypes the profiler saw, the error against float64, and which results equal the fp32
    kernel's on the same values, rounded once."""
    from ascendspeed.features.tp_comm_overlap.collectives import TpGroup

    from megatron.core import parallel_state

    from tests.helpers import megatron as mu

    mu.initialize_parallel(tp=world)
    group = TpGroup.of(parallel_state.get_tensor_model_parallel_group())
    names = ("output", "input grad", "weight grad", "bias grad")
    results, seed = {}, 100
    for kind in KINDS:
        for dtype in HALF_TOLERANCE:
            seed += 1
            full = _global_inputs(kind, SHAPES[1], world, dtype, seed)
            problem = _local_problem(kind, full, rank, world, SHAPES[1][0])
            # the inputs as the dtype holds them, so the fp32 kernel multiplies the same values
            problem.update({name: problem[name].to(dtype).double() for name in ("x", "w", "b", "g")
                            if problem.get(name) is not None})
            expected = (problem["out"], problem["grad_x"], problem["grad_w"], problem.get("grad_b"))
            for chunks in (1, 4):
                with torch.profiler.profile(record_shapes=True) as profile:
                    found = _run_chunked(kind, problem, dtype, chunks, group, fp32_products=True)
                wide = _run_chunked(kind, problem, torch.float32, chunks, group)
                results[(kind, str(dtype), chunks)] = {
                    "gemm_dtypes": gemm_operand_dtypes(profile),
                    "dtypes": {name: str(a.dtype) for name, a in zip(names, found) if a is not None},
                    "error": {name: _relative(a, e) for name, a, e in zip(names, found, expected) if e is not None},
                    "rounded_once": {name: torch.equal(a, w.to(dtype)) for name, a, w in zip(names, found, wide)
                                     if name in ROUNDED_ONCE[kind]},
                }
    mu.destroy_parallel()
    return results


def _half_precision_gpt(rank, world):
    """A bf16 GPT with TP 2 + SP on a CPU without a fast bf16 GEMM (``ASCENDSPEED_CPU_HALF_GEMM=fp32``), with
    and without CoC: the GEMM operand dtypes of the CoC step, and its losses and gradients against plain TP."""
    import os

    from ascendspeed import accelerator
    from ascendspeed.accelerator import cpu_half_gemm
    from ascendspeed.patching import MANAGER

    from tests.helpers import megatron as mu

    os.environ[cpu_half_gemm.ENVIRONMENT_VARIABLE] = "fp32"
    MANAGER.revert(accelerator.CPU_HALF_GEMM_FEATURE)
    MANAGER.apply(accelerator.CPU_HALF_GEMM_FEATURE, accelerator.cpu_half_gemm_patches())
    shape = mu.TinyGPT(seq_length=16)
    batch = mu.make_batch(shape, batch_size=2 * shape.micro_batch_size)
    runs = {}
    for chunks in (None, 2):
        coc = {} if chunks is None else dict(use_ascend_coc=True, coc_parallel_num=chunks)
        disable_features()
        enable_features(tensor_model_parallel_size=2, sequence_parallel=True, **coc)
        mu.initialize_parallel(tp=2)
        config = shape.config(sequence_parallel=True, add_bias_linear=True, bf16=True, params_dtype=torch.bfloat16,
                              pipeline_dtype=torch.bfloat16)
        ddp = mu.wrap_ddp(mu.build_model_chunks(config, shape))
        with torch.profiler.profile(record_shapes=True) as profile:
            losses = torch.stack(mu.run_forward_backward(ddp, batch, shape))
        runs[chunks] = {"losses": losses, "gemm_dtypes": gemm_operand_dtypes(profile),
                        "grads": {name: param.main_grad.clone() for name, param in mu.named_parameters_full(ddp)}}
        mu.destroy_parallel()
    disable_features()
    del os.environ[cpu_half_gemm.ENVIRONMENT_VARIABLE]
    MANAGER.revert(accelerator.CPU_HALF_GEMM_FEATURE)
    MANAGER.apply(accelerator.CPU_HALF_GEMM_FEATURE, accelerator.cpu_half_gemm_patches())
    plain, coc = runs[None], runs[2]
    return {"gemm_dtypes": coc["gemm_dtypes"], "loss_error": mu.relative_error(coc["losses"], plain["losses"]),
            "grad_errors": {name: mu.relative_error(grad, plain["grads"][name]) for name, grad in coc["grads"].items()}}


GPT_CASES = {
    "sequence_parallel": dict(sequence_parallel=True),
    "tensor_parallel": dict(sequence_parallel=False),
    "sequence_parallel_te_spec": dict(sequence_parallel=True, te_spec=True),
}


def _gpt_cases(rank, world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from tests.helpers import megatron as mu

    shape = mu.TinyGPT(seq_length=16)
    batch = mu.make_batch(shape, batch_size=2 * shape.micro_batch_size)
    results = {}
    for case, settings in GPT_CASES.items():
        sequence_parallel = settings["sequence_parallel"]
        spec = get_gpt_layer_with_transformer_engine_spec() if settings.get("te_spec") else None
        runs = {}
        for chunks in (None,) + CHUNKS:
            coc = {} if chunks is None else dict(use_ascend_coc=True, coc_parallel_num=chunks, log_tp_comm_overlap=True)
            disable_features()
            enable_features(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel, **coc)
            mu.initialize_parallel(tp=2)
            config = shape.config(sequence_parallel=sequence_parallel, add_bias_linear=True)
            chunks_ = mu.build_model_chunks(config, shape, layer_spec=spec)
            ddp = mu.wrap_ddp(chunks_)
            losses = torch.stack(mu.run_forward_backward(ddp, batch, shape))
            recorders = [feature.state.recorder for feature in applied_features() if feature.name == "tp_comm_overlap"]
            runs[chunks] = {
                "losses": losses,
                "grads": {name: param.main_grad.clone() for name, param in mu.named_parameters_full(ddp)},
                "collectives": recorders[0].take().collectives if recorders else 0,
            }
            mu.destroy_parallel()
        plain = runs[None]
        results[case] = {
            chunks: {
                "loss_error": mu.relative_error(runs[chunks]["losses"], plain["losses"]),
                "grad_errors": {name: mu.relative_error(grad, plain["grads"][name])
                                for name, grad in runs[chunks]["grads"].items()},
                "collectives": runs[chunks]["collectives"],
            }
            for chunks in CHUNKS
        }
    disable_features()
    return results


#: name -> (CoC chunks or None, --optimize-recomp-communication-level)
RECOMPUTE_RUNS = {
    "plain": (None, 0), "level1": (None, 1), "level2": (None, 2),
    "coc": (2, 0), "coc_level1": (2, 1), "coc_level2": (2, 2),
}
RECOMPUTE_SHAPE = dict(num_layers=4, recompute_num_layers=2, microbatches=2)


def _recompute_cases(rank, world):
    """Full recompute (uniform, two layers per checkpoint) with TP 2 + SP and dropout, each run of
    ``RECOMPUTE_RUNS``: losses, gradients and the collectives the telemetry counted."""
    from tests.helpers import megatron as mu

    shape = mu.TinyGPT(num_layers=RECOMPUTE_SHAPE["num_layers"])
    batch = mu.make_batch(shape, batch_size=RECOMPUTE_SHAPE["microbatches"] * shape.micro_batch_size)
    runs = {}
    for name, (chunks, level) in RECOMPUTE_RUNS.items():
        flags = dict(optimize_recomp_communication_level=level, recompute_granularity="full" if level else None)
        if chunks is not None:
            flags.update(use_ascend_coc=True, coc_parallel_num=chunks, log_tp_comm_overlap=True)
        disable_features()
        enable_features(tensor_model_parallel_size=2, sequence_parallel=True, **flags)
        mu.initialize_parallel(tp=2)
        config = shape.config(sequence_parallel=True, hidden_dropout=0.1, recompute_granularity="full",
                              recompute_method="uniform", recompute_num_layers=RECOMPUTE_SHAPE["recompute_num_layers"])
        ddp = mu.wrap_ddp(mu.build_model_chunks(config, shape))
        losses = torch.stack(mu.run_forward_backward(ddp, batch, shape))
        states = [feature.state for feature in applied_features() if feature.name == "tp_comm_overlap"]
        recorder = states[0].recorder if states else None
        runs[name] = {"losses": losses,
                      "grads": {n: p.main_grad.clone() for n, p in mu.named_parameters_full(ddp)},
                      "collectives": recorder.take().collectives if recorder is not None else None}
        mu.destroy_parallel()
    disable_features()
    plain = runs["plain"]
    return {name: {"loss_error": mu.relative_error(run["losses"], plain["losses"]),
                   "grad_error": max(mu.relative_error(g, plain["grads"][n]) for n, g in run["grads"].items()),
                   "collectives": run["collectives"]}
            for name, run in runs.items()}


def _job(rank, world):
    return {"operators": _operator_cases(rank, world), "half": _half_precision_cases(rank, world),
            "gpt": _gpt_cases(rank, world), "recompute": _recompute_cases(rank, world),
            "half_gpt": _half_precision_gpt(rank, world)}


@pytest.fixture(scope="module")
def job():
    return run_distributed(_job, 2, timeout=900)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_linears_match_a_float64_reference_and_megatron(job, kind):
    for rank, results in enumerate(job):
        for (case_kind, shape, dtype, chunks), result in results["operators"].items():
            if case_kind != kind:
                continue
            where = f"rank {rank} {kind} {shape} {dtype} {chunks} chunks"
            tolerance = TOLERANCE[getattr(torch, dtype.split(".")[-1])]
            for name, error in result["error"].items():
                # no worse than megatron-core's unchunked layer in the same dtype, and close to float64
                assert error <= max(tolerance, 2 * result["megatron_error"][name]), f"{where}: {name} {error:.2e}"
            if dtype == "torch.float32":
                worst = max(result["vs_megatron"], key=result["vs_megatron"].get)
                assert result["vs_megatron"][worst] <= 1e-6, f"{where}: {worst} vs megatron-core"


@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_without_a_fast_gemm_multiplies_in_fp32(job, kind):
    """With ``fp32_products`` only fp32 products run; what no collective sums after the rounding equals the fp32
    kernel's result on the same values rounded once, bit for bit; everything is close to float64."""
    for rank, results in enumerate(job):
        for (case_kind, dtype, chunks), result in results["half"].items():
            if case_kind != kind:
                continue
            where = f"rank {rank} {kind} {dtype} {chunks} chunks"
            assert result["gemm_dtypes"] == ["float"], f"{where}: {result['gemm_dtypes']}"
            assert set(result["dtypes"].values()) == {dtype}, f"{where}: {result['dtypes']}"
            assert all(result["rounded_once"].values()), f"{where}: {result['rounded_once']}"
            tolerance = HALF_TOLERANCE[getattr(torch, dtype.split(".")[-1])]
            for name, error in result["error"].items():
                assert error <= tolerance, f"{where}: {name} {error:.2e}"


def test_bf16_gpt_with_coc_multiplies_in_fp32_where_the_cpu_has_no_fast_bf16_gemm(job):
    for rank, results in enumerate(job):
        result = results["half_gpt"]
        assert result["gemm_dtypes"] == ["float"], f"rank {rank}: {result['gemm_dtypes']}"
        assert result["loss_error"] <= 1e-2, f"rank {rank}: loss {result['loss_error']:.2e}"
        worst = max(result["grad_errors"], key=result["grad_errors"].get)
        assert result["grad_errors"][worst] <= 2e-2, f"rank {rank}: {worst} {result['grad_errors'][worst]:.2e}"


def test_every_chunk_issues_its_own_collectives(job):
    operators = job[0]["operators"]
    for (kind, shape, dtype, chunks), result in operators.items():
        sharded, whole = min(chunks, shape[0]), min(chunks, 2 * shape[0])
        # with sequence parallelism the chunks split the local shard: column gathers forward, re-gathers and
        # reduce-scatters backward, row reduce-scatters forward and gathers backward; without it they split
        # the whole sequence, all-reduced once (row forward, column backward)
        expected = {"column_sp": 3 * sharded, "row_sp": 2 * sharded, "row": whole, "column": whole}
        assert result["collectives"] == expected[kind], (kind, shape, dtype, chunks, result["collectives"])


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_gpt_with_coc_equals_plain_tensor_parallel(job, case):
    for rank, results in enumerate(job):
        per_chunks = results["gpt"][case]
        for chunks, result in per_chunks.items():
            assert result["loss_error"] <= 1e-6, f"rank {rank} {case} {chunks}: loss {result['loss_error']:.2e}"
            worst = max(result["grad_errors"], key=result["grad_errors"].get)
            assert result["grad_errors"][worst] <= 1e-6, (
                f"rank {rank} {case} {chunks} chunks: {worst} differs by {result['grad_errors'][worst]:.2e}")
        counts = [per_chunks[chunks]["collectives"] for chunks in CHUNKS]
        assert counts[0] > 0 and counts == sorted(counts) and counts[-1] > counts[0], counts


@pytest.mark.parametrize("run", [name for name in RECOMPUTE_RUNS if name != "plain"])
def test_recompute_communication_levels_give_plain_full_recompute(job, run):
    for rank, results in enumerate(job):
        result = results["recompute"][run]
        assert result["loss_error"] <= 1e-6 and result["grad_error"] <= 1e-6, f"rank {rank} {run}: {result}"


def test_recompute_communication_levels_leave_out_collectives(job):
    counts = {name: job[0]["recompute"][name]["collectives"] for name in ("coc", "coc_level1", "coc_level2")}
    layers, per_checkpoint, microbatches = (RECOMPUTE_SHAPE[key] for key in
                                            ("num_layers", "recompute_num_layers", "microbatches"))
    chunks = RECOMPUTE_RUNS["coc"][0]
    skipped = layers // per_checkpoint * microbatches  # one last reduction per checkpoint and micro-batch
    # level 1: the skipped reduce-scatter's chunks forward and its chunked gathers backward, less the one
    # gather of the gradient that stays
    assert counts["coc"] - counts["coc_level1"] == skipped * (2 * chunks - 1), counts
    # level 2: the backward re-gather (one per chunk) of both column-parallel linears of every layer
    assert counts["coc_level1"] - counts["coc_level2"] == layers * 2 * chunks * microbatches, counts


def _validate(**flags):
    from ascendspeed.features import default_arguments

    args = default_arguments()
    for key, value in flags.items():
        setattr(args, key, value)
    feature = next(feature for feature in all_features() if feature.name == "tp_comm_overlap")
    feature.validate(args)
    return feature


@pytest.mark.parametrize("flags, message", [
    (dict(use_ascend_coc=True), "--tensor-model-parallel-size 1 has none"),
    (dict(coc_parallel_num=4), "--use-ascend-coc, which is off"),
    (dict(log_tp_comm_overlap=True), "neither is on"),
    (dict(use_ascend_coc=True, use_ascend_mc2=True, tensor_model_parallel_size=2), "pick one"),
    (dict(use_ascend_coc=True, tensor_model_parallel_size=2, tp_comm_overlap=True), "--tp-comm-overlap"),
    (dict(use_ascend_mc2=True, tensor_model_parallel_size=2), "add --sequence-parallel"),
    (dict(use_ascend_mc2=True, tensor_model_parallel_size=2, sequence_parallel=True),
     "use --use-ascend-coc, the portable equivalent"),
    (dict(optimize_recomp_communication_level=1, tensor_model_parallel_size=2), "add --recompute-granularity full"),
    (dict(optimize_recomp_communication_level=1, recompute_granularity="full"), "--tensor-model-parallel-size 1"),
    (dict(optimize_recomp_communication_level=2, recompute_granularity="full", tensor_model_parallel_size=2),
     "add --sequence-parallel or use level 1"),
])
def test_invalid_combinations_are_refused_naming_the_flags(flags, message):
    with pytest.raises(FeatureArgumentError, match=message.replace("-", r"\-").replace("(", r"\(")):
        _validate(**flags)


def test_coc_settings_default_to_two_chunks():
    feature = _validate(use_ascend_coc=True, tensor_model_parallel_size=2)
    args = argparse.Namespace(use_ascend_coc=True, coc_parallel_num=None, use_ascend_mc2=False,
                              log_tp_comm_overlap=False)
    assert feature.settings(args).chunks == 2
