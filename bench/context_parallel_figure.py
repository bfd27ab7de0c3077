"""Draw the balanced chunk layout of docs/features/context-parallel.md into sources/images/context_parallel_layout.png.

    python bench/context_parallel_figure.py [--cp 4] [--output sources/images/context_parallel_layout.png]

Top: the sequence cut into 2 x cp chunks, each coloured by the rank that holds it (rank r: chunks r and
2cp-1-r). Bottom: the causal attention matrix in chunks; a block is computed by the rank owning its
queries, at the ring step (number in the block) when that rank holds the keys; blocks above the diagonal
are skipped, diagonal blocks are causal (half work). Every rank gets the same amount of work.
"""
from __future__ import annotations

import argparse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--output", default="sources/images/context_parallel_layout.png")
    return parser.parse_args(argv)


def main(argv=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Polygon, Rectangle

    from ascendspeed.features.context_parallel.layout import chunk_ids

    args = parse_args(argv)
    cp, chunks = args.cp, 2 * args.cp
    owner = {chunk: rank for rank in range(cp) for chunk in chunk_ids(rank, cp)}
    colours = plt.get_cmap("tab10")
    figure, (strip, matrix) = plt.subplots(2, 1, figsize=(7, 8.6), gridspec_kw={"height_ratios": [1, 6]})

    for chunk in range(chunks):
        strip.add_patch(Rectangle((chunk, 0), 1, 1, facecolor=colours(owner[chunk]), edgecolor="white"))
        strip.text(chunk + 0.5, 0.5, f"chunk {chunk}\nrank {owner[chunk]}", ha="center", va="center", fontsize=8,
                   color="white")
    strip.set_xlim(0, chunks)
    strip.set_ylim(0, 1)
    strip.axis("off")
    strip.set_title(f"sequence in 2 x cp = {chunks} chunks: rank r holds chunks r and {chunks - 1}-r")

    work = [0.0] * cp
    for q_chunk in range(chunks):
        rank = owner[q_chunk]
        for k_chunk in range(q_chunk + 1):
            step = (rank - owner[k_chunk]) % cp
            y = chunks - 1 - q_chunk
            if k_chunk == q_chunk:
                triangle = [(k_chunk, y), (k_chunk, y + 1), (k_chunk + 1, y)]
                matrix.add_patch(Polygon(triangle, facecolor=colours(rank), edgecolor="white"))
                work[rank] += 0.5
            else:
                matrix.add_patch(Rectangle((k_chunk, y), 1, 1, facecolor=colours(rank), edgecolor="white"))
                work[rank] += 1
            matrix.text(k_chunk + 0.5 - 0.2 * (k_chunk == q_chunk), y + 0.5 - 0.2 * (k_chunk == q_chunk),
                        str(step), ha="center", va="center", fontsize=9, color="white")
    matrix.set_xlim(0, chunks)
    matrix.set_ylim(0, chunks)
    matrix.set_aspect("equal")
    matrix.set_xticks([c + 0.5 for c in range(chunks)], [str(c) for c in range(chunks)])
    matrix.set_yticks([c + 0.5 for c in range(chunks)], [str(chunks - 1 - c) for c in range(chunks)])
    matrix.set_xlabel("key chunk")
    matrix.set_ylabel("query chunk")
    matrix.set_title("causal attention by blocks: colour = rank computing it, number = ring step\n"
                     f"(work per rank in blocks: {', '.join(f'{w:g}' for w in work)})")
    matrix.legend(handles=[Patch(color=colours(r), label=f"rank {r}") for r in range(cp)], loc="upper right",
                  fontsize=8)
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
