"""`Schedule`: a stream weight that changes with the training step, declared up front.

A schedule is a list of `(step, weight)` points. `interpolate="constant"` holds each weight from its
step until the next point; `"linear"` interpolates between points (and holds the end weights
outside them). Steps are the loader's global steps (batches of `world_size x batch_size` samples,
counted from the start of training): the mixture order converts them to positions with the global
batch of the run's first iteration, pinned in the loader state, so an elastic resume with another
global batch keeps the schedule at the same samples.

A linear schedule is applied as a staircase: the weight is evaluated once per run of `quantum`
steps (at the run's middle), where the mixing order chooses `quantum` so that each constant piece
spans at least one mixing period; the stated mixing tolerance then holds inside every piece.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

INTERPOLATIONS = ("constant", "linear")


@dataclass(frozen=True)
class Schedule:
    """Piecewise weight of a `Stream`, by loader step.

    Args:
        points: `(step, weight)` pairs with strictly increasing integer steps >= 0 and weights >= 0
            (0 leaves the stream out from that step on; some stream must keep a positive weight).
        interpolate: "constant" (default) or "linear".

    Raises:
        ValueError: naming the point that is wrong.
    """

    points: tuple[tuple[int, float], ...]
    interpolate: str = "constant"

    def __post_init__(self) -> None:
        try:
            points = tuple((step, weight) for step, weight in self.points)
        except (TypeError, ValueError) as err:
            raise ValueError(f"Schedule points must be (step, weight) pairs, got {self.points!r}") from err
        if not points:
            raise ValueError("Schedule needs at least one (step, weight) point")
        for i, (step, weight) in enumerate(points):
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"Schedule point {i}: step must be an integer >= 0, got {step!r}")
            if (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight)
                    or weight < 0):
                raise ValueError(f"Schedule point {i}: weight must be a finite number >= 0, got {weight!r}")
            if i and step <= points[i - 1][0]:
                raise ValueError(f"Schedule point {i}: steps must increase strictly ({points[i - 1][0]} then {step})")
        if self.interpolate not in INTERPOLATIONS:
            raise ValueError(f"Schedule interpolate must be one of {INTERPOLATIONS}, got {self.interpolate!r}")
        object.__setattr__(self, "points", tuple((int(s), float(w)) for s, w in points))

    def at(self, step: float) -> float:
        """The weight at `step` (a float step interpolates linearly between the points of a linear schedule)."""
        steps = [s for s, _ in self.points]
        i = max((j for j, s in enumerate(steps) if s <= step), default=0)
        if self.interpolate == "constant" or step <= steps[0] or i == len(steps) - 1:
            return self.points[i][1]
        (s0, w0), (s1, w1) = self.points[i], self.points[i + 1]
        return w0 + (w1 - w0) * (step - s0) / (s1 - s0)

    def applied(self, step: int, quantum: int) -> float:
        """The weight the mixture uses at `step`: `at(step)`, or for linear schedules the value in the
        middle of the run of `quantum` steps holding `step`."""
        if self.interpolate == "constant":
            return self.at(step)
        first = step // quantum * quantum
        return self.at(first + (quantum - 1) / 2)

    def change_steps(self, quantum: int) -> list[int]:
        """Steps at which `applied` may change value (ascending)."""
        steps = [s for s, _ in self.points]
        if self.interpolate == "constant" or len(steps) == 1:
            return steps[1:]
        return list(range(steps[0] // quantum * quantum + quantum, steps[-1] + quantum, quantum))

    def to_json(self) -> dict[str, Any]:
        """The schedule as JSON-ready data: `{"schedule": [[step, weight], ...], "interpolate": bool}`."""
        return {"schedule": [list(p) for p in self.points], "interpolate": self.interpolate}


def weight_spec(weight: float | Schedule) -> float | dict[str, Any]:
    """A stream weight as JSON (a number, or a schedule's points and interpolation)."""
    return weight.to_json() if isinstance(weight, Schedule) else float(weight)


def weight_from_spec(spec: Any) -> float | Schedule:
    """Inverse of `weight_spec` (as read back from a loader state)."""
    if isinstance(spec, dict):
        return Schedule([tuple(p) for p in spec["schedule"]], interpolate=spec.get("interpolate", "constant"))
    return float(spec)


def parse_schedule(text: str, *, what: str) -> Schedule:
    """A schedule written as JSON points, optionally prefixed by its interpolation:
    `[[0,0.9],[10000,0.5]]` or `linear:[[0,0.9],[10000,0.5]]`.

    Raises:
        ValueError: naming `what` (e.g. the --data entry) and what is wrong.
    """
    interpolate, _, points = text.rpartition(":")
    try:
        parsed = json.loads(points)
        if not isinstance(parsed, list) or not all(isinstance(p, list) and len(p) == 2 for p in parsed):
            raise ValueError("expected a JSON list of [step, weight] pairs")
        return Schedule([tuple(p) for p in parsed], interpolate=interpolate or "constant")
    except ValueError as err:
        raise ValueError(f"{what}: bad weight schedule {text!r}: {err}") from None


def schedules_in(weights: Sequence[float | Schedule]) -> list[Schedule]:
    return [w for w in weights if isinstance(w, Schedule)]
