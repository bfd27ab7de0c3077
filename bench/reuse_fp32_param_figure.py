"""Draw the bit layout of ``--reuse-fp32-param`` from the real implementation.

Top: three fp32 main weights (rounded down, rounded up, a tie rounded down to even) split by
``ascendspeed.ops.bf16_split_`` (the layout switch's operator) into the bf16 weight (Megatron's cast) and the 16-bit remainder. Bottom: the int32
buffer of a real ``storage.ParameterUnit`` holding those weights, in the model layout (between steps:
bf16 weights | remainders) and in the main layout (during the step: fp32 main weights).

    python bench/reuse_fp32_param_figure.py sources/images/reuse_fp32_param.png
"""
from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ascendspeed.ops.bf16_split import bf16_split_  # noqa: E402
from ascendspeed.features.reuse_fp32_param.storage import ParameterUnit  # noqa: E402

EXAMPLES = [0x3F9A_3C21, 0xBE4C_C9D7, 0x4048_8000, 0x4049_8000]
HIGH, LOW, TIE = "#4C78A8", "#F58518", "#54A24B"


def bits_of(value: int, width: int) -> str:
    return format(value & ((1 << width) - 1), f"0{width}b")


def draw_bits(axis, y, text, colours, x0=0.0, label=""):
    for index, (bit, colour) in enumerate(zip(text, colours)):
        axis.add_patch(plt.Rectangle((x0 + index, y), 0.95, 0.8, color=colour, alpha=0.35))
        axis.text(x0 + index + 0.47, y + 0.4, bit, ha="center", va="center", fontsize=7, family="monospace")
    if label:
        axis.text(x0 - 0.5, y + 0.4, label, ha="right", va="center", fontsize=8)


def main(path: str) -> None:
    values = torch.tensor(EXAMPLES, dtype=torch.int64).to(torch.int32).view(torch.float32)
    halves, low = values.view(torch.int16).clone(), torch.empty(values.numel(), dtype=torch.int16)
    ties = bf16_split_(halves, 0, low)
    high = halves[: values.numel()]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 9.5), gridspec_kw={"height_ratios": [3, 1.3]})
    y = 0.0
    for index, value in enumerate(values.tolist()):
        u = int(values[index:index + 1].view(torch.int32).item())
        h, l = int(high[index].item()), int(low[index].item())
        tie = index in ties.tolist()
        if tie:
            rounding = "a tie, rounded down to even: its position is kept in the ties list"
        elif (l & 0xFFFF) == 0x8000:
            rounding = "a tie, rounded up to even"
        else:
            rounding = "rounded up" if (l & 0xFFFF) > 0x8000 else "rounded down"
        top.text(-13, y + 2.9, f"fp32 main weight {value:.9g}  ({rounding})", fontsize=9, weight="bold")
        draw_bits(top, y + 2, bits_of(u, 32), [HIGH] * 16 + [LOW] * 16, label="fp32 bits")
        draw_bits(top, y + 1, bits_of(h, 16), [HIGH] * 16,
                  label=f"bf16 weight = RNE cast ({torch.tensor([h], dtype=torch.int16).view(torch.bfloat16).item():.6g})")
        draw_bits(top, y + 1, bits_of(l, 16), [TIE if tie else LOW] * 16, x0=16, label="")
        top.text(32.5, y + 1.4, "remainder = low 16 bits", fontsize=8, va="center")
        y -= 3.6
    top.set_xlim(-14, 42)
    top.set_ylim(y + 2.5, 3.6)
    top.axis("off")
    top.set_title("--reuse-fp32-param: an fp32 main weight = its bf16 weight + a 16-bit remainder\n"
                  "(the remainder is the low half; a remainder above 0x8000 means the bf16 weight rounded up)",
                  fontsize=10)

    param = torch.nn.Parameter(values.to(torch.bfloat16))
    unit = ParameterUnit([param])
    unit.write(values)
    halves = unit.buffer.view(torch.int16)
    n = unit.numel
    model_layout = [f"w{i} bf16" for i in range(n)] + [f"w{i} rem" for i in range(n)]
    unit.to_main_layout()
    assert torch.equal(unit.main_params()[0].view(torch.int32), values.view(torch.int32))
    main_layout = [f"w{i // 2} {'low' if i % 2 == 0 else 'high'}" for i in range(2 * n)]
    unit.to_model_layout()
    assert torch.equal(halves[:n], high)
    for row, (labels, title) in enumerate(((model_layout, "between steps: the model reads the first half as bf16"),
                                           (main_layout, "during the step: the whole buffer is the fp32 main weight"))):
        yy = 1.2 - row * 1.2
        for index, label in enumerate(labels):
            colour = HIGH if ("bf16" in label or "high" in label) else LOW
            bottom.add_patch(plt.Rectangle((index * 2, yy), 1.9, 0.8, color=colour, alpha=0.35))
            bottom.text(index * 2 + 0.95, yy + 0.4, label, ha="center", va="center", fontsize=8)
        bottom.text(2 * len(labels) + 0.3, yy + 0.4, title, va="center", fontsize=8)
    bottom.text(0, 2.3, f"one int32 buffer of {n} elements ({4 * n} bytes), viewed as bf16, int16 and fp32 "
                "(Tensor.view(dtype)): 4 bytes per parameter instead of 2 + 4", fontsize=9, weight="bold")
    bottom.set_xlim(-0.5, 40)
    bottom.set_ylim(-0.2, 2.7)
    bottom.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sources/images/reuse_fp32_param.png")
