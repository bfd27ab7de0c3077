"""``torchrun --nproc-per-node N -m ascendspeed.training.pretrain_gpt [Megatron-LM flags]``.

Without flags it trains the embedded default job: a small byte-level GPT on a public-domain novel
shipped with the package, then reports validation perplexity. See docs/training.md.

Exit status: 0 when training finished, 2 for a usage error (a flag out of range or inconsistent), 1 when
the run had to stop (``TrainingError``: diverged, checkpoint unreadable or unwritable, data too short);
the message names the file or flag and what to do.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ascendspeed.adaptor import install

    install()
    # The entry runs megatron-core's own modules by design; these import-time notices would only repeat that.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.errors import Terminated, TrainingError
    from ascendspeed.training.trainer import train

    args = parse_args(argv)
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and args.world_size > 1 else ""
    try:
        train(args)
    except TrainingError as error:
        # One write with its newline: ranks share stderr, and print() writes the text and the newline
        # apart, so another rank's line could land in between.
        sys.stderr.write(f"{prefix}pretrain_gpt: error: {error}\n")
        sys.stderr.flush()
        return 1
    except Terminated as stop:
        sys.stderr.write(f"{prefix}pretrain_gpt: {stop}; temporary checkpoint files removed, the latest complete "
                         f"checkpoint (if any) stays the latest\n")
        sys.stderr.flush()
        return 128 + stop.signum
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
