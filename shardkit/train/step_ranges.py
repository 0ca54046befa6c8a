"""`--skip-steps` values: sets of optimizer steps kept as sorted, disjoint inclusive ranges.

A range is two numbers whatever its length: `1-99999999999999` costs what `7` costs, in the config, in
the checkpoint's marker and in every membership test (a binary search), never a set of its members.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable


class StepRanges:
    """An immutable set of steps (from 1), as sorted, disjoint, non-adjacent inclusive ranges."""

    __slots__ = ("_firsts", "_lasts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()):
        merged: list[list[int]] = []
        for first, last in sorted(ranges):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        self._firsts = tuple(first for first, _ in merged)
        self._lasts = tuple(last for _, last in merged)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._firsts, self._lasts))

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        index = bisect.bisect_right(self._firsts, step) - 1
        return index >= 0 and step <= self._lasts[index]

    def __or__(self, other: StepRanges) -> StepRanges:
        return StepRanges(self.ranges + other.ranges)

    def __bool__(self) -> bool:
        return bool(self._firsts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepRanges) and self.ranges == other.ranges

    def __hash__(self) -> int:
        return hash(tuple(self.ranges))

    def __len__(self) -> int:
        """The number of steps (arithmetic on the ranges)."""
        return sum(last - first + 1 for first, last in self.ranges)

    def __str__(self) -> str:
        """The canonical text: runs joined as ranges ('3-5,9')."""
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in self.ranges)

    def __repr__(self) -> str:
        return f"StepRanges({str(self)!r})"


def parse_steps(text: str) -> StepRanges:
    """The steps of a `--skip-steps` value: step numbers (from 1) and inclusive ranges A-B, separated by commas.

    Raises:
        ValueError: an entry that is neither, naming it.
    """
    ranges = []
    for entry in re.split(r"[,\s]+", str(text or "").strip()):
        if not entry:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", entry)
        first, last = (int(match[1]), int(match[2] or match[1])) if match else (0, -1)
        if match is None or not 1 <= first <= last:
            raise ValueError(f"--skip-steps entry {entry!r}: expected a step N >= 1 or a range A-B with 1 <= A <= B")
        ranges.append((first, last))
    return StepRanges(ranges)


def format_steps(steps: StepRanges | Iterable[int]) -> str:
    """The canonical text of a set of steps: sorted, runs joined as ranges ('3-5,9')."""
    if not isinstance(steps, StepRanges):
        steps = StepRanges((step, step) for step in steps)
    return str(steps)
