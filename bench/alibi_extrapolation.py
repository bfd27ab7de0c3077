"""Train short, test long: the same small GPT trained with ALiBi and with RoPE at length L, evaluated at L, 2L, 4L.

    python bench/alibi_extrapolation.py [--seq-length 128] [--train-iters 600] [--output FILE.json]
                                        [--plot sources/images/alibi_extrapolation.png] [-- extra training flags]
    python bench/alibi_extrapolation.py --replot FILE.json --plot sources/images/alibi_extrapolation.png

Both runs use ascendspeed's pretraining entry on its embedded corpus (a byte-level GPT on a public-domain
novel) with identical flags and seed, only ``--position-embedding-type`` differs. The validation split is
scored in non-overlapping windows of each evaluation length. ALiBi is expected to stay within 5% of its
perplexity at L up to 4L (the paper's result); RoPE, trained at L only, degrades.
"""
from __future__ import annotations

import argparse
import json
import tempfile

POSITIONS = ("alibi", "rope")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--train-iters", type=int, default=600)
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--plot", help="draw perplexity against evaluation length into this PNG")
    parser.add_argument("--replot", metavar="JSON", help="only draw --plot from the results of an earlier --output")
    parser.add_argument("training_flags", nargs="*", help="more flags for the pretraining entry (after --)")
    return parser.parse_args(argv)


def training_flags(args, position: str) -> list[str]:
    length = args.seq_length
    return [
        "--position-embedding-type", position,
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8",
        "--seq-length", str(length), "--micro-batch-size", "16",
        "--train-iters", str(args.train_iters), "--lr", "2e-3", "--min-lr", "2e-4",
        "--lr-warmup-iters", str(max(1, args.train_iters // 20)),
        "--log-interval", str(max(1, args.train_iters // 6)), "--eval-interval", str(10 * args.train_iters),
        "--eval-seq-lengths", str(length), str(2 * length), str(4 * length),
        *args.training_flags,
    ]


def run(args) -> dict:
    import ascendspeed.megatron_adaptor  # noqa: F401 - megatron-core on this machine's device

    import torch

    from ascendspeed.training.arguments import parse_args as parse_training_args
    from ascendspeed.training.trainer import train

    results = {}
    with tempfile.TemporaryDirectory() as store:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        try:
            for position in POSITIONS:
                outcome = train(parse_training_args(training_flags(args, position), world_size=1))
                results[position] = {
                    "final_train_loss": outcome.losses[-1],
                    "perplexity": {str(r.seq_length): r.perplexity for r in outcome.final_validation},
                }
        finally:
            torch.distributed.destroy_process_group()
    return results


def plot(results: dict, seq_length: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"alibi": "ALiBi", "rope": "RoPE"}
    figure, axis = plt.subplots(figsize=(6, 4))
    for position, result in results.items():
        lengths = sorted(int(length) for length in result["perplexity"])
        axis.plot(lengths, [result["perplexity"][str(length)] for length in lengths], marker="o",
                  label=labels[position])
    axis.axvline(seq_length, color="grey", linestyle=":", label=f"training length L = {seq_length}")
    axis.set_xscale("log", base=2)
    axis.set_xticks([seq_length, 2 * seq_length, 4 * seq_length],
                    [f"L = {seq_length}", f"2L = {2 * seq_length}", f"4L = {4 * seq_length}"])
    axis.set_xlabel("evaluation length (tokens)")
    axis.set_ylabel("validation perplexity (bytes)")
    axis.set_title("Train short, test long: same GPT, two position encodings")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as handle:
            saved = json.load(handle)
        plot(saved["results"], saved["seq_length"], args.plot)
        return
    results = run(args)
    lengths = [args.seq_length * k for k in (1, 2, 4)]
    print(f"\nvalidation perplexity, trained at L={args.seq_length} for {args.train_iters} iterations")
    print(f"{'':<8}" + "".join(f"{length:>10}" for length in lengths) + f"{'4L / L':>10}")
    for position, result in results.items():
        ppl = [result["perplexity"][str(length)] for length in lengths]
        print(f"{position:<8}" + "".join(f"{value:>10.3f}" for value in ppl) + f"{ppl[2] / ppl[0]:>10.3f}")
        result["ratio_4L_over_L"] = ppl[2] / ppl[0]
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"seq_length": args.seq_length, "train_iters": args.train_iters, "results": results},
                      handle, indent=2)
    if args.plot:
        plot(results, args.seq_length, args.plot)


if __name__ == "__main__":
    main()
