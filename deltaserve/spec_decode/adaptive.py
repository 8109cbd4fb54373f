"""`AdaptiveVerifier`: a load-aware policy choosing how many draft positions each request verifies per step (and
whether to draft at all) to maximise expected tokens per second under a `StepCostModel`; lossless by construction,
since it only shortens the proposals offered to verification."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from deltaserve.spec_decode.cost_model import CostCurve, StepCostModel


@dataclass(slots=True)
class AdaptiveStats:
    """Counters since the verifier was built (each a Prometheus counter, except `last_total`, a gauge)."""

    num_steps: int = 0
    """Steps decided: `choose` calls with at least one request."""
    num_offered_positions: int = 0
    """Draft positions the drafter offered to `choose` (the sum of the confidence list lengths)."""
    num_verified_positions: int = 0
    """Draft positions `choose` kept for verification (the sum of its answers)."""
    num_draft_off_steps: int = 0
    """`drafts_for` (`should_draft`) calls that answered 0: steps whose drafter forward was skipped."""
    last_total: int = 0
    """Draft positions verified in all by the latest `choose` (a gauge)."""


def scan_totals(
    gains: npt.ArrayLike, step_seconds: npt.ArrayLike, *, base_tokens: float
) -> tuple[int, float]:
    """The best number M of draft positions to verify, and its expected rate (tokens per second).

    Verifying the first M of `gains` (marginal expected accepted tokens, sorted non-increasing) yields ``(base_tokens
    + sum(gains[:M])) / step_seconds[M]`` (`step_seconds`: one more entry than `gains`, all > 0); the smallest
    maximising M in ``0..len(gains)`` wins. Gains <= 0 are never taken: such a position cannot be accepted.
    """
    gain = np.asarray(gains, dtype=np.float64)
    seconds = np.asarray(step_seconds, dtype=np.float64)
    if seconds.shape != (gain.size + 1,):
        raise ValueError(f"step_seconds: {seconds.shape} for {gain.size} gains (needs one more)")
    usable = int(np.count_nonzero(gain > 0.0))  # sorted non-increasing: the positive ones come first
    tokens = base_tokens + np.concatenate(([0.0], np.cumsum(gain[:usable])))
    rates = tokens / seconds[:usable + 1]
    best = int(np.argmax(rates))  # the first maximum: the smallest M
    return best, float(rates[best])


VERIFY_RIDGE = 0.25
"""`_affine_fit` keeps the verification ratio near 1 unless the verified extra times seen spread by more than about
this share of their mean: steps that all verify alike cannot tell a fixed cost from a per-token one."""


def _affine_fit(ex: float, ey: float, exx: float, exy: float) -> tuple[float, float]:
    """(fixed, ratio) of y = fixed + ratio * x from the moments E[x], E[y], E[x x], E[x y]: least squares with a
    ridge pulling the ratio towards 1 (`VERIFY_RIDGE`); ratio clamped to [1/4, 8], fixed to >= 0."""
    var, cov = max(exx - ex * ex, 0.0), exy - ex * ey
    ridge = (VERIFY_RIDGE * ex) ** 2
    ratio = (cov + ridge) / (var + ridge) if var + ridge > 0.0 else 1.0
    ratio = min(max(ratio, 0.25), 8.0)
    return max(ey - ratio * ex, 0.0), ratio


def _clamp01(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """`values` clamped to [0, 1]; NaN reads as 0 (no confidence)."""
    return np.where(values >= 0.0, np.minimum(values, 1.0), 0.0)


def _ema(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average; the first observation starts it (no bias towards an arbitrary prior)."""
    return new if old is None else (1.0 - weight) * old + weight * new


def _check_other_rows(num_other_seqs: int, num_other_tokens: int) -> None:
    """Rows that are not speculating: ``0 <= num_other_seqs <= num_other_tokens``, and no tokens without rows."""
    if num_other_seqs < 0 or num_other_tokens < num_other_seqs or (num_other_seqs == 0 and num_other_tokens != 0):
        raise ValueError(f"num_other_tokens={num_other_tokens} must be >= num_other_seqs={num_other_seqs} >= 0 "
                         f"(and 0 without other rows)")


def _carry_forward(values: Sequence[float | None]) -> list[float] | None:
    """Each None replaced by the nearest earlier value (positions never reached borrow the last one seen); None when
    position 0 has no value (then nothing has been observed: reaching position j needs positions < j accepted)."""
    if not values or values[0] is None:
        return None
    out: list[float] = []
    for v in values:
        out.append(out[-1] if v is None else v)
    return out


VERIFY_MARGIN = 1.05
"""`choose` verifies drafts only where the expected rate beats verifying none by this factor: the cost model's
errors (noise, the start-up measurement missing per-step overheads) must not turn small predicted wins into losses."""
DRAFT_MARGIN = 1.05
"""`drafts_for` keeps drafting only where the best expected rate with drafting beats plain decoding by this factor
(drafting itself is paid on every step). 2026-12-08: 1.15 kept drafting off on tool-chat at concurrency 1 where it
was judged 1.06x and static verification made 1.06x: adaptive 0.96x of no-spec; with 1.05, 1.11x."""
CONTEXT_BUCKET = 64
"""Context lengths are rounded down to a multiple of this many tokens for the cost model's curves (cached)."""
IDLE_STEPS = 16
"""Consecutive steps whose drafts were all refused after which drafting pauses (see `should_draft`)."""
PROBE_INTERVAL = 8
"""While paused, one step in this many drafts again, to see whether its drafts now pay."""
EXPLORE_MARGIN = 0.85
"""Where drafting is judged not to pay but its best expected rate is within this factor of plain decoding's (the
judgement is close, and rests on acceptance rates that stop being observed once drafting is off), one step in
`EXPLORE_INTERVAL` drafts anyway; further below, never (at high load a drafting step costs the most)."""
EXPLORE_INTERVAL = 32
"""Where drafting falls short by less than `EXPLORE_MARGIN`, one step in this many drafts (at least: `PROBE_BUDGET`)."""
PROBE_BUDGET = 0.01
"""Probing and exploring steps are spaced so that their cost (one request's drafter forward and the verification of
its drafts) is at most this share of the time of plain steps (2026-12-07: at batch 16, probes every 8 steps of whole
batches' drafts cost 5%)."""
REJUDGE_INTERVAL = 16
"""`should_draft` reuses its judgement of a step shape (batch, context bucket, other rows) for this many calls while
nothing it rests on changed but the plain steps' time ratio (an EMA that drifts slowly): judging costs ~0.2 ms next
to a batch-64 step whose caches the forward just evicted (2026-12-07), ~2% of the step, paid on every step that does
not draft."""


class AdaptiveVerifier:
    """Chooses m_r, the draft positions request r verifies this step, maximising expected tokens per second.

    A step of B sequences (the speculating ones plus `num_other_seqs`) and Q = B_spec + sum m_r + `num_other_tokens`
    query tokens takes ``cost_model.predict(B, Q, ctx) + cost_model.predict_draft(B_spec)`` seconds and yields
    ``B_spec + num_other_tokens + sum_r E_r(m_r)`` tokens of progress, where ``E_r(m) = sum_{j<m} prod_{i<=j} c_ri``
    (every query token of the other rows counts: a prefill chunk's tokens are work done, so drafts must be as cheap per
    token as the step's own work, never slowing a step full of prefill for a small gain; speculating rows count their
    one token plus their expected accepted drafts). For a fixed total M = sum m_r the best split takes
    the M largest marginal gains ``prod_{i<=j} c_ri`` (they decrease in j, so each request gets a prefix: exact, by
    concavity), and M is scanned over 0..sum n_r. `ctx` is the mean context length of the speculating requests,
    rounded.

    Calibration: the drafter's confidences are scaled, per position j, by ``ema(accepted / offered) / ema(mean
    confidence offered)`` observed in real steps (`observe`; both averages start at the first step's mean confidence,
    a prior of scale 1 worth one step), then clamped to [0, 1]. "Offered at j" counts requests
    that verified position j *and* had every earlier draft accepted: a draft after a rejection is never judged.
    Positions never observed borrow the nearest earlier position's statistics; with none, scales are 1.

    Not thread-safe; one instance per engine core, called once per step.
    """

    def __init__(self, cost_model: StepCostModel, num_speculative_tokens: int, *, ema: float = 0.1,
                 correct_with_step_times: bool = True) -> None:
        """`num_speculative_tokens` (k >= 1): the most drafts per request; `ema` in (0, 1]: the weight of the newest
        step in the per-position averages; `correct_with_step_times`: `observe_step` corrects the cost model (False:
        decisions depend only on the cost model and the drafts, not on the machine's timing: tests)."""
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be an int >= 1")
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema={ema!r} must be in (0, 1]")
        self.cost_model, self.correct_with_step_times = cost_model, correct_with_step_times
        self._k = num_speculative_tokens
        self._weight = float(ema)
        self._accept_ema: list[float | None] = [None] * num_speculative_tokens
        self._conf_ema: list[float | None] = [None] * num_speculative_tokens
        self._offered_ema: list[float | None] = [None] * num_speculative_tokens
        """Per position: the EMA of the mean calibrated confidence `choose` was offered (what `should_draft` judges by
        while no verified step has been observed: a verifier that never verifies never observes)."""
        self.stats = AdaptiveStats()
        self._idle_steps = 0
        """Consecutive `choose` calls that verified nothing."""
        self._curves: dict[tuple[int, int], CostCurve] = {}
        self._step_seconds: dict[tuple[int, int, int, int], npt.NDArray[np.float64]] = {}
        self._plain_ema: float | None = None
        """Real / predicted seconds of steps that verified nothing (None: none seen yet)."""
        self._verify_moments: tuple[float, float, float, float] | None = None
        """EMAs of x, y, x * x and x * y over verifying steps (x: the predicted extra seconds of the tokens verified,
        y: what the step took beyond its plain part and the drafter); None until one is seen."""
        self._verify_fit = (0.0, 1.0)
        """(fixed seconds, ratio): a verifying step costs its plain part + fixed + ratio * x (`_affine_fit`)."""
        self._since_probe = 0
        self._version = 0
        """Bumped whenever the acceptance rates, offered confidences or verification costs change (judgements stale)."""
        self._calls = 0
        self._judgements: dict[tuple[int, int, int, int], tuple[int, int, float, float]] = {}
        """`should_draft` step shape -> (version, call it expires at, best rate / plain rate, probe interval floor)."""

    @property
    def num_speculative_tokens(self) -> int:
        """k: the most draft positions per request."""
        return self._k

    @property
    def acceptance_rates(self) -> tuple[float | None, ...]:
        """Per position j: the EMA of P(draft j accepted | drafts < j accepted) seen in real steps (None: not yet)."""
        return tuple(self._accept_ema)

    @property
    def calibration_scales(self) -> tuple[float, ...]:
        """Per position j: the factor applied to the drafter's confidence (1.0 before any observation, and where the
        mean confidence offered is 0, which gives no ratio)."""
        rates, confs = _carry_forward(self._accept_ema), _carry_forward(self._conf_ema)
        if rates is None or confs is None:
            return (1.0,) * self._k
        return tuple(r / c if c > 0.0 else 1.0 for r, c in zip(rates, confs, strict=True))

    def calibrate(self, confidences: Sequence[float]) -> list[float]:
        """One request's drafter confidences (at most k), clamped to [0, 1], scaled per position, clamped again."""
        raw, _ = self._padded([confidences])
        return self._calibrated(raw)[0, :len(confidences)].tolist()

    def _padded(self, confidences: Sequence[Sequence[float]]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
        """The raw confidences clamped to [0, 1] as a ``[R, k]`` array, 0 past each request's drafts, and the
        ``[R, k]`` mask of the real ones."""
        lengths = np.fromiter((len(c) for c in confidences), dtype=np.int64, count=len(confidences))
        if lengths.size and lengths.max() > self._k:
            raise ValueError(f"{lengths.max()} confidences for num_speculative_tokens={self._k}")
        mask = np.arange(self._k) < lengths[:, None]  # [R, k]
        raw = np.zeros((len(confidences), self._k))
        raw[mask] = np.fromiter(itertools.chain.from_iterable(confidences), dtype=np.float64, count=int(lengths.sum()))
        return _clamp01(raw), mask

    def _calibrated(self, raw: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """``[R, k]`` clamped confidences scaled per position and clamped again."""
        return _clamp01(raw * np.asarray(self.calibration_scales, dtype=np.float64))

    def choose(
        self,
        confidences: Sequence[Sequence[float]],
        context_lens: Sequence[int],
        *,
        num_other_seqs: int = 0,
        num_other_tokens: int = 0,
        drafting: bool = True,
    ) -> list[int]:
        """m_r for each decoding request r, with ``0 <= m_r <= len(confidences[r])``: verify its first m_r drafts.

        Args:
            confidences: per decoding request, the drafter's confidence of each draft (at most k; empty: no drafts).
            context_lens: per decoding request, its context length in tokens.
            num_other_seqs: rows in the step that are not speculating (prefill chunks, plain decodes).
            num_other_tokens: their query tokens in all (>= num_other_seqs; 0 without such rows).
            drafting: whether the drafter runs in this step (the `should_draft` answer for it): its time counts.
        """
        num_spec = len(confidences)
        if len(context_lens) != num_spec:
            raise ValueError(f"{len(context_lens)} context_lens for {num_spec} requests")
        _check_other_rows(num_other_seqs, num_other_tokens)
        if num_spec == 0:
            return []
        raw, mask = self._padded(confidences)
        calibrated = self._calibrated(raw)
        counts = mask.sum(axis=0).tolist()
        for j, (total, count) in enumerate(zip(calibrated.sum(axis=0).tolist(), counts, strict=True)):  # 0 past drafts
            if count:
                self._offered_ema[j] = _ema(self._offered_ema[j], total / count, self._weight)
        self._version += 1
        gains = np.cumprod(calibrated, axis=1)[mask]  # marginal gain of each real draft, request-major
        requests, positions = np.nonzero(mask)
        # Best first; ties: earlier positions first (keeps prefixes), then spread across requests.
        order = np.lexsort((requests, positions, -gains))
        num_seqs = num_spec + num_other_seqs
        overhead = self.cost_model.predict_draft(num_spec) if drafting else 0.0
        base_query_tokens = num_spec + num_other_tokens
        seconds = self._corrected(self._seconds(num_seqs, round(sum(context_lens) / num_spec), base_query_tokens,
                                                gains.size) + overhead)
        total, rate = scan_totals(gains[order], seconds, base_tokens=base_query_tokens)
        if total and rate < VERIFY_MARGIN * base_query_tokens / seconds[0]:
            total = 0
        chosen = np.bincount(requests[order[:total]], minlength=num_spec).tolist()
        self.stats.num_steps += 1
        self.stats.num_offered_positions += int(gains.size)
        self.stats.num_verified_positions += total
        self.stats.last_total = total
        self._idle_steps = 0 if total else self._idle_steps + 1
        return chosen

    def should_draft(self, num_seqs: int, context_len: int, *, num_other_seqs: int = 0,
                     num_other_tokens: int = 0) -> bool:
        """Whether the workers draft at all after the next step (`drafts_for` > 0)."""
        return self.drafts_for(num_seqs, context_len, num_other_seqs=num_other_seqs,
                               num_other_tokens=num_other_tokens) > 0

    def drafts_for(self, num_seqs: int, context_len: int, *, num_other_seqs: int = 0,
                   num_other_tokens: int = 0) -> int:
        """How many of the next step's `num_seqs` decoding requests (at `context_len`) the workers draft for: all of
        them where drafting can beat plain decoding, one on a probing or exploring step, else 0.

        Compares the best expected rate with drafting (every request drafting k positions with the observed
        `acceptance_rates` as confidences, the drafter's time included) against ``B / predict(B, B, ctx)``. Before any
        verified step it judges by the calibrated confidences `choose` was offered (a verifier that verifies nothing
        still learns that drafting does not pay); all before either; 0 for no requests. Call it every step, also
        while off: the rates stay as last seen, and a smaller load brings drafting back.

        And drafting whose drafts `choose` keeps refusing is wasted: after IDLE_STEPS consecutive choices of nothing,
        drafting is off except for one probe step every PROBE_INTERVAL calls (a verified position ends the pause).
        Where drafting is judged not to pay by a small margin (`EXPLORE_MARGIN`), one step in EXPLORE_INTERVAL drafts
        anyway, so that acceptance rates estimated from a few early steps can be corrected (2026-12-07: code edits at
        batch 1 turned drafting off for good after 10 steps whose position-2 rate was half the long-run one). Probing
        and exploring steps draft for one request (the rates are per position, not per batch: a whole batch's drafter
        forward and verification on such steps cost ~5% at batch 4, 2026-12-07), and both intervals stretch where
        even that drafter forward is dear next to a plain step (`PROBE_BUDGET`). A judgement is reused for the same
        step shape until the rates or costs it rests on change (`REJUDGE_INTERVAL` calls at most).
        """
        _check_other_rows(num_other_seqs, num_other_tokens)
        if num_seqs <= 0:
            return 0
        self._calls += 1
        key = (num_seqs, context_len // CONTEXT_BUCKET, num_other_seqs, num_other_tokens)
        judged = self._judgements.get(key)
        if judged is None or judged[0] != self._version or judged[1] <= self._calls:
            if len(self._judgements) >= 4096:
                self._judgements.clear()
            judged = self._judgements[key] = (self._version, self._calls + REJUDGE_INTERVAL,
                                              *self._judge(num_seqs, context_len, num_other_seqs, num_other_tokens))
        _, _, gain, probe_floor = judged
        if gain > DRAFT_MARGIN and self._idle_steps < IDLE_STEPS:
            return num_seqs
        interval = PROBE_INTERVAL if gain > DRAFT_MARGIN else EXPLORE_INTERVAL if gain > EXPLORE_MARGIN else 0
        if interval:
            self._since_probe += 1
            if self._since_probe >= max(interval, probe_floor):
                self._since_probe = 0
                return 1
        self.stats.num_draft_off_steps += 1
        return 0

    def _judge(self, num_seqs: int, context_len: int, num_other_seqs: int, num_other_tokens: int
               ) -> tuple[float, float]:
        """(best expected rate with drafting / plain decoding's rate, the fewest steps between probes that keeps
        their cost within PROBE_BUDGET) for `drafts_for`; (inf, 0) before anything was observed."""
        rates = _carry_forward(self._accept_ema) or _carry_forward(self._offered_ema)
        if rates is None:
            return math.inf, 0.0
        # Every request's position j before any position j + 1 (all requests alike).
        gains = np.repeat(np.cumprod(_clamp01(np.asarray(rates, dtype=np.float64))), num_seqs)
        base = num_seqs + num_other_tokens
        seconds = self._seconds(num_seqs + num_other_seqs, context_len, base, gains.size)
        plain_rate = base / (seconds[0] * self._plain_ratio)
        draft = self.cost_model.predict_draft(num_seqs)
        _, best_rate = scan_totals(gains, self._corrected(seconds + draft), base_tokens=base)
        # A probe costs one request's drafter forward and, the step after, the verification of its k drafts (with a
        # verifying step's fixed cost): 2026-12-07, counting the drafter alone let probes cost ~3% at batch 4.
        verify = self._corrected(seconds)
        probe = self.cost_model.predict_draft(1) + float(verify[self._k] - verify[0])
        return best_rate / plain_rate, math.ceil(probe / (PROBE_BUDGET * base / plain_rate))

    def _curve(self, num_seqs: int, context_len: int) -> CostCurve:
        """The cost model's curve at this batch size and context, cached (the context to CONTEXT_BUCKET tokens: a
        decision costs a dictionary lookup, not an interpolation, on every step)."""
        key = (num_seqs, context_len // CONTEXT_BUCKET)
        curve = self._curves.get(key)
        if curve is None:
            if len(self._curves) >= 4096:
                self._curves.clear()
            curve = self._curves[key] = self.cost_model.cost_curve(num_seqs, key[1] * CONTEXT_BUCKET)
        return curve

    def _seconds(self, num_seqs: int, context_len: int, base_tokens: int, num_drafts: int
                 ) -> npt.NDArray[np.float64]:
        """Predicted step seconds with `base_tokens` + 0, 1, ..., `num_drafts` query tokens (`_curve`'s step),
        cached like the curves: in a steady state every step asks the same question (a read-only array)."""
        key = (num_seqs, context_len // CONTEXT_BUCKET, base_tokens, num_drafts)
        seconds = self._step_seconds.get(key)
        if seconds is None:
            if len(self._step_seconds) >= 4096:
                self._step_seconds.clear()
            seconds = self._curve(num_seqs, context_len).many(base_tokens + np.arange(num_drafts + 1))
            seconds.flags.writeable = False
            self._step_seconds[key] = seconds
        return seconds

    def _corrected(self, seconds: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """Predicted step seconds for 0, 1, 2, ... verified drafts, corrected by what real steps took: the plain
        part by the plain steps' ratio; verifying anything adds the fixed cost of a verifying step, and the tokens'
        share of the forward is scaled by the verification ratio."""
        plain = seconds[0] * self._plain_ratio
        fixed, ratio = self._verify_fit
        return np.concatenate([[plain], plain + fixed + (seconds[1:] - seconds[0]) * ratio])

    def observe_step(self, num_seqs: int, num_tokens: int, context_len: int, seconds: float, *,
                     num_drafting: int = 0, verified: bool = False) -> None:
        """One real step of `num_seqs` rows and `num_tokens` query tokens took `seconds` (everything the engine did
        in it): the cost model measured at start-up times only the forward, so what real steps take corrects it.
        Plain steps: the ratio of real to predicted time (an EMA, clamped to [1/4, 8]). Verifying steps: their time
        beyond the plain part and the drafter, y, against the predicted extra time of the tokens verified, x, fitted
        as y = fixed + ratio * x (`_affine_fit`): a verifying step pays a fixed cost (verification sampling, kept
        draft distributions, bookkeeping) whatever it verifies, which a ratio alone charged to the tokens and so
        over-priced long verifications after short ones. Both start from the start-up model (ratio 1, no fixed
        cost), not from their first observation: a process's first verifying step pays one-time costs (2026-12-07:
        a ratio set to its cap by it stayed there for the whole run).
        `num_drafting`: requests the workers drafted for after the step (their drafter time is in `seconds`)."""
        if num_seqs <= 0 or seconds <= 0 or not self.correct_with_step_times:
            return
        seconds_by_tokens = self._seconds(num_seqs, context_len, num_seqs, max(num_tokens - num_seqs, 0))
        predicted, plain = float(seconds_by_tokens[-1]), float(seconds_by_tokens[0])
        draft = self.cost_model.predict_draft(num_drafting) if num_drafting else 0.0
        if not verified:
            self._plain_ema = _ema(self._plain_ratio, min(max(seconds / (predicted + draft), 0.25), 8.0), self._weight)
            return
        # The step's plain part at the plain ratio and the drafter as predicted, as `_corrected` prices a choice;
        # what is left is the verification's. One observation counts at most 8x the step's predicted time.
        base = plain * self._plain_ratio + draft
        x = max(predicted - plain, 0.0)
        y = min(max(seconds - base, 0.0), 8.0 * (base + x))
        prior = self._verify_moments or (x, x, x * x, x * x)  # the start-up model: y = x at this step's size
        w = self._weight
        self._verify_moments = moments = tuple(  # type: ignore[assignment]
            (1.0 - w) * old + w * new for old, new in zip(prior, (x, y, x * x, x * y), strict=True))
        self._verify_fit = _affine_fit(*moments)
        self._version += 1

    @property
    def _plain_ratio(self) -> float:
        return 1.0 if self._plain_ema is None else self._plain_ema

    @property
    def cost_corrections(self) -> tuple[float, float]:
        """(plain, verification) ratios of real to predicted step time (1.0 until steps of each kind are seen)."""
        return self._plain_ratio, self._verify_fit[1]

    @property
    def verify_overhead(self) -> float:
        """Seconds a verifying step costs beyond its plain part, drafter and tokens (0 until one is seen)."""
        return self._verify_fit[0]

    def observe(self, offered: Sequence[int], accepted: Sequence[int], confidences: Sequence[Sequence[float]]) -> None:
        """One verified step: request r verified `offered[r]` drafts (its m_r), of which the first `accepted[r]` were
        accepted; `confidences[r]` are the drafter's raw confidences it was offered (``offered[r] <= len <= k``)."""
        if not len(offered) == len(accepted) == len(confidences):
            raise ValueError(f"lengths differ: offered {len(offered)}, accepted {len(accepted)}, "
                             f"confidences {len(confidences)}")
        for r, (num_offered, num_accepted, conf) in enumerate(zip(offered, accepted, confidences, strict=True)):
            if not 0 <= num_accepted <= num_offered <= len(conf) <= self._k:
                raise ValueError(f"request {r}: need 0 <= accepted ({num_accepted}) <= offered ({num_offered}) <= "
                                 f"len(confidences) ({len(conf)}) <= k ({self._k})")
        if not offered:
            return
        raw, _ = self._padded(confidences)
        position = np.arange(self._k)
        verified = np.asarray(offered, dtype=np.int64)[:, None]  # [R, 1]
        kept = np.asarray(accepted, dtype=np.int64)[:, None]  # [R, 1]
        reached = (verified > position) & (kept >= position)  # [R, k]: verified, every earlier draft kept
        num_reached = reached.sum(axis=0)
        num_kept = (kept > position).sum(axis=0)
        conf_sum = (raw * reached).sum(axis=0)
        for j in range(self._k):
            if num_reached[j] == 0:  # nor any later position: reaching j + 1 needs reaching j
                break
            mean_conf = float(conf_sum[j] / num_reached[j])
            # A position's averages start at the drafter's own confidence (scale 1), as if one step had seen it
            # accepted as often as it claimed: one rejected draft must not zero its scale, which would stop the
            # position (and every later one) from being verified, and so from ever being judged again.
            self._accept_ema[j] = _ema(mean_conf if self._accept_ema[j] is None else self._accept_ema[j],
                                       float(num_kept[j] / num_reached[j]), self._weight)
            self._conf_ema[j] = _ema(mean_conf if self._conf_ema[j] is None else self._conf_ema[j], mean_conf,
                                     self._weight)
        self._version += 1
