"""Draw the ALiBi bias explained in docs/features/alibi.md into sources/images/alibi.png.

    python bench/alibi_bias_figure.py [--heads 8] [--tokens 10] [--output sources/images/alibi.png]

Left: the distances -(i - j) between query i and the keys j it may see (future keys are masked).
Middle: the bias -m_h (i - j) that heads with a steep, a middle and a gentle slope add to q.k / sqrt(d).
Right: exp(-m_h d), the factor by which each head scales the attention weight of a key d tokens back.
"""
from __future__ import annotations

import argparse

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=10)
    parser.add_argument("--output", default="sources/images/alibi.png")
    return parser.parse_args(argv)


def main(argv=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ascendspeed.ops.alibi import alibi_slopes

    args = parse_args(argv)
    n = args.tokens
    slopes = alibi_slopes(args.heads).tolist()
    distance = np.arange(n)[:, None] - np.arange(n)[None, :]
    future = distance < 0
    shown_heads = [0, args.heads // 2 - 1, args.heads - 1]

    figure, axes = plt.subplots(1, 2 + len(shown_heads), figsize=(4 * (2 + len(shown_heads)), 4.2))
    heatmaps, decay = axes[:-1], axes[-1]
    grid = np.ma.masked_where(future, -distance.astype(float))
    axes[0].imshow(grid, cmap="Greys_r", vmin=-n, vmax=n / 3)
    for i in range(n):
        for j in range(i + 1):
            axes[0].text(j, i, f"{-(i - j)}", ha="center", va="center", fontsize=8,
                         color="black" if i - j < n / 2 else "white")
    axes[0].set_title("distance -(i - j)\n(future keys masked)")

    image = None
    for axis, head in zip(heatmaps[1:], shown_heads):
        bias = np.ma.masked_where(future, -slopes[head] * distance)
        image = axis.imshow(bias, cmap="viridis", vmin=-slopes[0] * (n - 1), vmax=0)
        axis.set_title(f"head {head + 1} of {args.heads}: m = 2^{np.log2(slopes[head]):.0f}\nbias = -m (i - j)")
    for axis in heatmaps:
        axis.set_xlabel("key position j")
        axis.set_xticks(range(n))
        axis.set_yticks(range(n))
        axis.tick_params(labelsize=7)
    axes[0].set_ylabel("query position i")
    figure.colorbar(image, ax=heatmaps[1:].tolist(), shrink=0.8, label="added to q.k / sqrt(d)")

    distances = np.arange(0, 257)
    colors = plt.cm.viridis(np.linspace(0, 0.9, args.heads))
    for head, slope in enumerate(slopes):
        decay.plot(distances, np.exp(-slope * distances), color=colors[head], label=f"m = 2^{np.log2(slope):.0f}")
    decay.set_xlabel("distance i - j (tokens)")
    decay.set_ylabel("attention weight factor exp(-m (i - j))")
    decay.set_title("each head looks this far back")
    decay.legend(fontsize=7, ncol=2)
    figure.suptitle("ALiBi: softmax(q.k / sqrt(d) - m_h (i - j)); slopes m_h = 2^(-8h/H), fixed, one per head")
    figure.savefig(args.output, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
