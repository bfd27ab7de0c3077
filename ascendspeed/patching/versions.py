"""Release numbers and ranges of them, for patches written for some megatron-core releases only."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

_RELEASE = re.compile(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def release(text: str) -> tuple[int, int, int]:
    """``"0.16"`` -> (0, 16, 0); ``"0.19.2rc1"`` -> (0, 19, 2). A text with no leading number is an error."""
    match = _RELEASE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a release number such as 0.16 or 0.16.1")
    return tuple(int(part or 0) for part in match.groups())


@dataclasses.dataclass(frozen=True)
class VersionRange:
    """Releases ``low <= v < high`` (either bound may be open), written ``">=0.15,<0.17"``."""

    low: Optional[tuple[int, int, int]] = None
    high: Optional[tuple[int, int, int]] = None

    @classmethod
    def parse(cls, text: str) -> "VersionRange":
        low = high = None
        for clause in filter(None, (part.strip() for part in text.split(","))):
            if clause.startswith(">="):
                low = release(clause[2:])
            elif clause.startswith("<"):
                high = release(clause[1:])
            else:
                raise ValueError(f"version range {text!r}: write clauses as '>=A' and '<B', got {clause!r}")
        return cls(low, high)

    def __contains__(self, version: str | tuple) -> bool:
        found = release(version) if isinstance(version, str) else tuple(version)
        return (self.low is None or found >= self.low) and (self.high is None or found < self.high)

    def __str__(self) -> str:
        def text(bound):
            return ".".join(map(str, bound))

        parts = ([f">={text(self.low)}"] if self.low else []) + ([f"<{text(self.high)}"] if self.high else [])
        return ",".join(parts) or "any"
