"""`StepCostModel`: measured forward-step times on a (context, batch, tokens per sequence) grid, interpolated, plus the
drafter's time per batch size; `measure_cost_model` fills one from timing callables the engine provides."""

from __future__ import annotations

import bisect
import math
import numbers
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

MIN_STEP_SECONDS = 1e-6
"""Floor of every `StepCostModel.predict`: extrapolation below the grid may reach zero, no forward step is faster than
a microsecond, and a positive step time keeps the rates the verifier divides by finite."""


def _segment(xs: Sequence[float], x: float) -> tuple[int, int, float]:
    """The segment ``(lo, hi)`` of `xs` (strictly increasing, >= 2 points) that `x` falls in or extends past, and
    ``t = (x - xs[lo]) / (xs[hi] - xs[lo])`` (< 0 left of the grid, > 1 right of it)."""
    lo = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return lo, lo + 1, (x - xs[lo]) / (xs[lo + 1] - xs[lo])


def _lerp(a: float, b: float, t: float) -> float:
    """`a` + (`b` - `a`) * `t` inside the segment; past either end the slope is clamped to >= 0, so the result never
    decreases in `t` beyond the grid even where the measured end segment does (timing noise)."""
    if 0.0 <= t <= 1.0:
        return a + (b - a) * t
    return b + max(b - a, 0.0) * (t - 1.0) if t > 1.0 else a + max(b - a, 0.0) * t


def _interp(xs: Sequence[float], rows: Sequence[Sequence[float]], x: float) -> list[float]:
    """Piecewise-linear interpolation of the vectors `rows[i]` (at `xs[i]`, strictly increasing) at `x`, element by
    element, extended past the grid as `_lerp` does; a single point is a constant."""
    if len(xs) == 1:
        return list(rows[0])
    lo, hi, t = _segment(xs, x)
    return [_lerp(a, b, t) for a, b in zip(rows[lo], rows[hi], strict=True)]


def _check_axis(name: str, values: Sequence[int], minimum: int) -> tuple[int, ...]:
    """`values` as a tuple of ints >= `minimum`, strictly increasing and not empty; the ValueError names the field."""
    if not values:
        raise ValueError(f"StepCostModel.{name}: needs at least one value")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
            raise ValueError(f"StepCostModel.{name}: {v!r} is not an int >= {minimum}")
    out = tuple(int(v) for v in values)
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"StepCostModel.{name}: {list(out)} is not strictly increasing")
    return out


def _check_seconds(name: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"StepCostModel.{name}: {value!r} is not a finite number of seconds")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"StepCostModel.{name}: {value!r} must be {'> 0' if positive else '>= 0'}")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostCurve:
    """Step seconds of `num_seqs` sequences at one context length, against the step's total query tokens: piecewise
    linear in tokens per sequence through (`query_lens`, `seconds`), extended past them as `StepCostModel` does, and
    floored at `MIN_STEP_SECONDS`. Built by `StepCostModel.cost_curve`."""

    num_seqs: int
    """Sequences in the step (>= 1)."""
    query_lens: tuple[int, ...]
    """Query tokens per sequence of the knots (`StepCostModel.query_lens`)."""
    seconds: tuple[float, ...]
    """Step seconds at each knot, already interpolated to `num_seqs` and the context length."""

    def many(self, num_tokens: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Step seconds for each total of query tokens in `num_tokens` (each >= `num_seqs`), vectorised."""
        tokens = np.asarray(num_tokens, dtype=np.float64)
        if tokens.size and tokens.min() < self.num_seqs:
            raise ValueError(f"num_tokens={tokens.min():g} must be >= num_seqs={self.num_seqs}")
        ys = np.asarray(self.seconds, dtype=np.float64)
        if len(ys) == 1:
            return np.maximum(np.full_like(tokens, ys[0]), MIN_STEP_SECONDS)
        xs = np.asarray(self.query_lens, dtype=np.float64)
        lo = np.clip(np.searchsorted(xs, tokens / self.num_seqs, side="right") - 1, 0, len(xs) - 2)
        t = (tokens / self.num_seqs - xs[lo]) / (xs[lo + 1] - xs[lo])
        a, b = ys[lo], ys[lo + 1]
        rise = np.maximum(b - a, 0.0)  # past the knots the slope is clamped to >= 0 (see `_lerp`)
        out = np.where(t > 1.0, b + rise * (t - 1.0), np.where(t < 0.0, a + rise * t, a + (b - a) * t))
        return np.maximum(out, MIN_STEP_SECONDS)

    def __call__(self, num_tokens: int) -> float:
        """Step seconds for `num_tokens` query tokens in all (>= `num_seqs`)."""
        return float(self.many([num_tokens])[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCostModel:
    """Seconds of one target-model forward step, measured on a grid, and of one drafter forward.

    A step runs `num_seqs` sequences with `num_tokens` query tokens in all (`num_tokens / num_seqs` per sequence) over
    contexts of `context_len` tokens each. `predict` is piecewise-linear in context length, batch size and tokens per
    sequence (interpolated in that order), extends each axis linearly past the grid with its end slope clamped to
    >= 0 (a noisy end segment that falls is extended flat, never downwards), and is floored at `MIN_STEP_SECONDS`
    (extrapolating below the grid can reach 0). Inside the grid it is non-decreasing in each argument when the table
    is non-decreasing along each axis; past the grid it is too, for tables whose increments do not shrink with the
    other axes (measured step times). The table is kept as measured: no smoothing. Lists given to the constructor are
    stored as tuples.
    """

    batch_sizes: tuple[int, ...]
    """Sequences per step at which the step was timed: ints >= 1, strictly increasing."""
    query_lens: tuple[int, ...]
    """Query tokens per sequence at which the step was timed (e.g. 1 and k + 1): ints >= 1, strictly increasing."""
    context_lens: tuple[int, ...]
    """Context tokens per sequence at which the step was timed: ints >= 0, strictly increasing, at least one."""
    seconds: tuple[tuple[tuple[float, ...], ...], ...]
    """``seconds[c][b][q]``: step time at `context_lens[c]`, `batch_sizes[b]`, `query_lens[q]`; finite, > 0."""
    draft_seconds: tuple[float, ...]
    """``draft_seconds[b]``: one drafter forward for `batch_sizes[b]` requests; finite, >= 0 (all 0: drafting free)."""

    def __post_init__(self) -> None:
        # Frozen: normalised values go in through object.__setattr__, once, here.
        batch = _check_axis("batch_sizes", self.batch_sizes, 1)
        qlens = _check_axis("query_lens", self.query_lens, 1)
        ctxs = _check_axis("context_lens", self.context_lens, 0)
        if len(self.seconds) != len(ctxs):
            raise ValueError(f"StepCostModel.seconds: {len(self.seconds)} rows for {len(ctxs)} context_lens")
        table = []
        for c, by_batch in enumerate(self.seconds):
            if len(by_batch) != len(batch):
                raise ValueError(f"StepCostModel.seconds[{c}]: {len(by_batch)} rows for {len(batch)} batch_sizes")
            rows = []
            for b, by_q in enumerate(by_batch):
                if len(by_q) != len(qlens):
                    raise ValueError(f"StepCostModel.seconds[{c}][{b}]: {len(by_q)} values for {len(qlens)} query_lens")
                rows.append(tuple(_check_seconds(f"seconds[{c}][{b}][{q}]", v, positive=True)
                                  for q, v in enumerate(by_q)))
            table.append(tuple(rows))
        if len(self.draft_seconds) != len(batch):
            raise ValueError(f"StepCostModel.draft_seconds: {len(self.draft_seconds)} values for {len(batch)} "
                             f"batch_sizes")
        draft = tuple(_check_seconds(f"draft_seconds[{b}]", v, positive=False)
                      for b, v in enumerate(self.draft_seconds))
        object.__setattr__(self, "batch_sizes", batch)
        object.__setattr__(self, "query_lens", qlens)
        object.__setattr__(self, "context_lens", ctxs)
        object.__setattr__(self, "seconds", tuple(table))
        object.__setattr__(self, "draft_seconds", draft)

    def cost_curve(self, num_seqs: int, context_len: int) -> CostCurve:
        """Step seconds against `num_tokens` for a fixed batch and context (``cost_curve(n, c)(t) == predict(n, t,
        c)``): the context and batch interpolation done once, for callers that scan many totals."""
        if num_seqs < 1:
            raise ValueError(f"num_seqs={num_seqs} must be >= 1")
        if context_len < 0:
            raise ValueError(f"context_len={context_len} must be >= 0")
        by_batch = _interp(self.context_lens, [[v for row in plane for v in row] for plane in self.seconds],
                           context_len)
        width = len(self.query_lens)
        rows = [by_batch[b * width:(b + 1) * width] for b in range(len(self.batch_sizes))]
        return CostCurve(num_seqs=num_seqs, query_lens=self.query_lens,
                         seconds=tuple(_interp(self.batch_sizes, rows, num_seqs)))

    def predict(self, num_seqs: int, num_tokens: int, context_len: int) -> float:
        """Seconds of a step of `num_seqs` sequences (>= 1) with `num_tokens` query tokens in all (>= num_seqs) over
        `context_len` context tokens each (>= 0)."""
        return self.cost_curve(num_seqs, context_len)(num_tokens)

    def predict_draft(self, num_seqs: int) -> float:
        """Seconds of one drafter forward for `num_seqs` requests (0.0 for none), piecewise-linear in batch size."""
        if num_seqs < 0:
            raise ValueError(f"num_seqs={num_seqs} must be >= 0")
        if num_seqs == 0:
            return 0.0
        return max(_interp(self.batch_sizes, [[v] for v in self.draft_seconds], num_seqs)[0], 0.0)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (lists of numbers), for logs and for shipping the model to the engine core process."""
        return {
            "batch_sizes": list(self.batch_sizes),
            "query_lens": list(self.query_lens),
            "context_lens": list(self.context_lens),
            "seconds": [[list(row) for row in plane] for plane in self.seconds],
            "draft_seconds": list(self.draft_seconds),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepCostModel:
        """The inverse of `to_json`; a missing or unknown key, or a malformed value, raises a ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"StepCostModel: expected a dict, got {type(data).__name__}")
        fields = ("batch_sizes", "query_lens", "context_lens", "seconds", "draft_seconds")
        for key in fields:
            if key not in data:
                raise ValueError(f"StepCostModel.{key}: missing")
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"StepCostModel: unknown field(s) {unknown}")

        def seq(key: str, value: Any, depth: int) -> tuple[Any, ...]:
            if not isinstance(value, list | tuple):
                raise ValueError(f"StepCostModel.{key}: expected a list, got {type(value).__name__}")
            return tuple(seq(key, v, depth - 1) for v in value) if depth > 1 else tuple(value)

        return cls(batch_sizes=seq("batch_sizes", data["batch_sizes"], 1),
                   query_lens=seq("query_lens", data["query_lens"], 1),
                   context_lens=seq("context_lens", data["context_lens"], 1),
                   seconds=seq("seconds", data["seconds"], 3),
                   draft_seconds=seq("draft_seconds", data["draft_seconds"], 1))


def measure_cost_model(
    time_step: Callable[[int, int, int], float],
    *,
    batch_sizes: Sequence[int],
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    time_draft: Callable[[int], float] | None = None,
    repeats: int = 3,
) -> StepCostModel:
    """Times every grid point and returns the model: per point the median of `repeats` calls, then each point capped
    by the cheapest point of more query tokens at its batch size and context (a step of more tokens never costs
    less, and timing noise only adds time: a first point slowed by the machine would otherwise make verification
    look free next to it, which the corrections from real steps then inflate to their cap; seen on 2026-12-07).

    Args:
        time_step: ``time_step(num_seqs, num_tokens, context_len) -> seconds`` runs one target step (the engine's
            callable, warmed up by the caller) with ``num_tokens = num_seqs * query_len``.
        batch_sizes, query_lens, context_lens: the grid axes (see the `StepCostModel` fields), checked before timing.
        time_draft: ``time_draft(num_seqs) -> seconds`` runs one drafter forward; None: drafting costs nothing.
        repeats: calls per point (>= 1); the median is kept.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1")
    batch = _check_axis("batch_sizes", batch_sizes, 1)
    qlens = _check_axis("query_lens", query_lens, 1)
    ctxs = _check_axis("context_lens", context_lens, 0)

    def median(fn: Callable[..., float], *args: int) -> float:
        return statistics.median(fn(*args) for _ in range(repeats))

    seconds = tuple(tuple(_suffix_min([median(time_step, b, b * q, c) for q in qlens]) for b in batch) for c in ctxs)
    draft = tuple(median(time_draft, b) if time_draft is not None else 0.0 for b in batch)
    return StepCostModel(batch_sizes=batch, query_lens=qlens, context_lens=ctxs, seconds=seconds, draft_seconds=draft)


def _suffix_min(values: list[float]) -> tuple[float, ...]:
    """Each value capped by every value after it (non-decreasing)."""
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(out)
