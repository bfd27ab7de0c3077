"""``torchrun --nproc-per-node N -m ascendspeed.training.pretrain_gpt [Megatron-LM flags]``.

Without flags it trains the embedded default job: a small byte-level GPT on a public-domain novel
shipped with the package, then reports validation perplexity. See docs/training.md.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ascendspeed.adaptor import install

    install()
    # The entry runs megatron-core's own modules by design; these import-time notices would only repeat that.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
