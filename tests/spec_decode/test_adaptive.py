"""`AdaptiveVerifier` and `StepCostModel`: the load-aware verification policy on synthetic cost models (no timing):
verify all when memory-bound, nothing when compute-bound, the greedy scan equals a brute-force optimum, drafting turns
off under load and back on when it drops, calibration, and the cost model's interpolation, JSON and validation."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Sequence

import pytest

from deltaserve.spec_decode.adaptive import (
    CONTEXT_BUCKET,
    EXPLORE_INTERVAL,
    IDLE_STEPS,
    PROBE_INTERVAL,
    REJUDGE_INTERVAL,
    VERIFY_MARGIN,
    AdaptiveStats,
    AdaptiveVerifier,
    scan_totals,
)
from deltaserve.spec_decode.cost_model import MIN_STEP_SECONDS, StepCostModel, measure_cost_model

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def grid_model(
    step: Callable[[int, int, int], float],
    *,
    query_lens: Sequence[int] = (1, 9),
    context_lens: Sequence[int] = (0, 4096),
    batch_sizes: Sequence[int] = BATCHES,
    draft: Callable[[int], float] = lambda b: 0.0,
) -> StepCostModel:
    """A cost model tabulating `step(num_seqs, num_tokens, context_len)` on the grid (no timing)."""
    return StepCostModel(
        batch_sizes=tuple(batch_sizes), query_lens=tuple(query_lens), context_lens=tuple(context_lens),
        seconds=tuple(tuple(tuple(step(b, b * q, c) for q in query_lens) for b in batch_sizes) for c in context_lens),
        draft_seconds=tuple(draft(b) for b in batch_sizes),
    )


def memory_bound(b: int, q: int, c: int) -> float:
    """10 ms of weight reads; each query token adds 1 us."""
    return 0.010 + 1e-6 * q


def compute_bound(b: int, q: int, c: int) -> float:
    """100 us per query token, nothing else."""
    return 1e-4 * q


def roofline(b: int, q: int, c: int) -> float:
    """Memory-bound (10 ms) up to 200 query tokens, then 50 us per token."""
    return max(0.010, 5e-5 * q)


def expected_rate(model: StepCostModel, confidences: Sequence[Sequence[float]], context_lens: Sequence[int],
                  chosen: Sequence[int], *, num_other_seqs: int = 0, num_other_tokens: int = 0) -> float:
    """The objective, written out: (B_spec + other tokens + sum_r sum_{j<m_r} prod_{i<=j} c_ri) / (cost(B, Q, ctx) +
    draft(B_spec))."""
    gained = 0.0
    for conf, m in zip(confidences, chosen, strict=True):
        prob = 1.0
        for c in conf[:m]:
            prob *= c
            gained += prob
    num_spec = len(confidences)
    batch = num_spec + num_other_seqs
    ctx = round(sum(context_lens) / num_spec)
    seconds = model.predict(batch, num_spec + num_other_tokens + sum(chosen), ctx) + model.predict_draft(num_spec)
    return (num_spec + num_other_tokens + gained) / seconds


def brute_force(model: StepCostModel, confidences: Sequence[Sequence[float]], context_lens: Sequence[int],
                **others: int) -> float:
    """The best rate over every m vector (0 <= m_r <= n_r); verifying none unless the best beats it by
    VERIFY_MARGIN."""
    best = max(expected_rate(model, confidences, context_lens, m, **others)
               for m in itertools.product(*(range(len(c) + 1) for c in confidences)))
    none = expected_rate(model, confidences, context_lens, [0] * len(confidences), **others)
    return best if best >= VERIFY_MARGIN * none else none


def observe_steps(verifier: AdaptiveVerifier, rate: float, *, steps: int = 50, batch: int = 40,
                  confidence: float = 0.9) -> None:
    """Feeds steps in which each request verified all k drafts and position j was accepted (given the earlier ones)
    with frequency `rate` exactly (deterministic: the first round(rate * reached) requests reaching j accept it)."""
    k = verifier.num_speculative_tokens
    for _ in range(steps):
        accepted = [0] * batch
        alive = list(range(batch))
        for _j in range(k):
            alive = alive[:round(rate * len(alive))]
            for r in alive:
                accepted[r] += 1
        verifier.observe([k] * batch, accepted, [[confidence] * k] * batch)


def test_memory_bound_batch_1_verifies_everything():
    """One request, confident drafts, a step as cheap with 8 tokens as with 1: every draft is verified."""
    verifier = AdaptiveVerifier(grid_model(memory_bound, draft=lambda b: 1e-3), 8)
    assert verifier.choose([[0.9] * 8], [100]) == [8]
    assert verifier.should_draft(1, 100)


def test_compute_bound_batch_64_verifies_nothing():
    """At batch 64 with cost linear in tokens, a draft (gain < 1 per token of cost) never pays: m = 0 everywhere, and
    once acceptance is observed, drafting turns off."""
    verifier = AdaptiveVerifier(grid_model(compute_bound), 4)
    assert verifier.choose([[0.9] * 4] * 64, [100] * 64) == [0] * 64
    observe_steps(verifier, 0.9)
    assert not verifier.should_draft(64, 100)


def test_drafts_that_are_always_refused_pause_drafting_with_probes():
    """choose() verifying nothing for IDLE_STEPS steps pauses drafting even where should_draft's rates say it may
    pay; one probe every PROBE_INTERVAL calls drafts again (a cheap drafter: see PROBE_BUDGET for dear ones), and a
    verified position ends the pause."""
    verifier = AdaptiveVerifier(grid_model(memory_bound, draft=lambda b: 1e-5), 8)
    assert verifier.should_draft(1, 100)
    for _ in range(IDLE_STEPS):
        assert verifier.choose([[0.0] * 8], [100]) == [0]
    observe_steps(verifier, 0.9, batch=1)  # the rates say drafting pays; the refusals say otherwise
    answers = [verifier.should_draft(1, 100) for _ in range(2 * PROBE_INTERVAL)]
    assert answers.count(True) == 2 and answers[PROBE_INTERVAL - 1] and answers[-1]
    # At batch 8 the probes draft for one request, not the batch (the rates they keep current are per position).
    assert [verifier.drafts_for(8, 100) for _ in range(PROBE_INTERVAL)] == [0] * (PROBE_INTERVAL - 1) + [1]
    assert verifier.choose([[0.9] * 8], [100]) == [8]  # the probe's drafts pay: the pause ends
    assert verifier.should_draft(1, 100)


def test_a_verifier_that_never_verifies_still_turns_drafting_off():
    """No verified step means no acceptance to observe: the offered confidences decide instead."""
    verifier = AdaptiveVerifier(grid_model(compute_bound), 4)
    assert verifier.should_draft(64, 100)  # nothing known yet
    assert verifier.choose([[0.9] * 4] * 64, [100] * 64) == [0] * 64
    assert not verifier.should_draft(64, 100)
    assert verifier.should_draft(1, 100) == (verifier.choose([[0.9] * 4], [100]) != [0])


def test_intermediate_load_takes_the_top_marginal_positions():
    """Two requests, 1 s per step plus 0.1 s per token: the confident request's 4 drafts (gains 0.9 .. 0.66) pay,
    the weak request's (0.3, 0.09) do not; the answer is the brute-force optimum."""
    model = grid_model(lambda b, q, c: 1.0 + 0.1 * q)
    confidences = [[0.9] * 4, [0.3, 0.3]]
    chosen = AdaptiveVerifier(model, 4).choose(confidences, [10, 10])
    assert chosen == [4, 0]
    assert expected_rate(model, confidences, [10, 10], chosen) == pytest.approx(brute_force(model, confidences,
                                                                                            [10, 10]), rel=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_greedy_scan_equals_brute_force(seed: int):
    """Random small cases (1-3 requests, 0-4 drafts, other rows, various roofline costs): the greedy scan's rate equals
    the exact optimum over all m vectors, and m_r <= n_r."""
    rng = random.Random(seed)
    base, per_token, knee = rng.uniform(1e-3, 1e-2), 10 ** rng.uniform(-6, -2), rng.choice([1, 4, 16, 64])
    draft_per_seq = rng.choice([0.0, base / 10])
    model = grid_model(lambda b, q, c: base + per_token * max(q - knee, 0) * (1 + c / 1000) + 1e-7 * q,
                       query_lens=(1, 2, 5), context_lens=(0, 1000), draft=lambda b: draft_per_seq * b)
    num_spec = rng.randint(1, 3)
    confidences = [[rng.random() for _ in range(rng.randint(0, 4))] for _ in range(num_spec)]
    context_lens = [rng.randint(0, 2000) for _ in range(num_spec)]
    num_other_seqs = rng.randint(0, 3)
    num_other_tokens = num_other_seqs + (rng.randint(0, 8) if num_other_seqs else 0)
    others = {"num_other_seqs": num_other_seqs, "num_other_tokens": num_other_tokens}
    chosen = AdaptiveVerifier(model, 4).choose(confidences, context_lens, num_other_seqs=num_other_seqs,
                                               num_other_tokens=num_other_tokens)
    assert all(0 <= m <= len(c) for m, c in zip(chosen, confidences, strict=True))
    assert expected_rate(model, confidences, context_lens, chosen, **others) == pytest.approx(
        brute_force(model, confidences, context_lens, **others), rel=1e-12)


def test_choice_is_a_prefix_bounded_by_the_drafts():
    """Requests without drafts get 0; no request gets more than it offered; no requests, no answer."""
    verifier = AdaptiveVerifier(grid_model(memory_bound), 4)
    assert verifier.choose([[], [0.9, 0.9], [0.8]], [5, 5, 5]) == [0, 2, 1]
    assert verifier.choose([], []) == []
    assert verifier.choose([[0.0, 0.9]], [5]) == [0]  # a zero-confidence draft cuts the chain


def test_other_rows_count_in_the_batch():
    """Plain decode rows that push the step past the roofline knee make drafts unprofitable."""
    verifier = AdaptiveVerifier(grid_model(roofline), 4)
    assert verifier.choose([[0.9] * 4] * 4, [50] * 4) == [4] * 4
    assert verifier.choose([[0.9] * 4] * 4, [50] * 4, num_other_seqs=252, num_other_tokens=252) == [0] * 4


def test_prefill_tokens_in_the_step_count_as_work():
    """A step carrying a long prefill chunk: drafts that cost as much per token as the chunk's own tokens are not
    verified (counting the chunk as one unit of progress would verify them)."""
    verifier = AdaptiveVerifier(grid_model(compute_bound), 4)
    assert verifier.choose([[0.99] * 4], [50], num_other_seqs=1, num_other_tokens=400) == [0]


def test_should_draft_off_at_high_load_and_back_when_it_drops():
    """With acceptance 0.8 on a roofline model: drafting pays at batch 8, not at batch 256, and comes back at 8
    without any new observation (the EMA is re-evaluated every step)."""
    verifier = AdaptiveVerifier(grid_model(roofline, query_lens=(1, 5), draft=lambda b: 1e-3), 4)
    assert verifier.should_draft(8, 100)  # nothing observed yet: draft, to learn the rates
    observe_steps(verifier, 0.8)
    assert verifier.acceptance_rates == pytest.approx((0.8,) * 4, abs=0.03)
    assert verifier.should_draft(8, 100)
    assert not verifier.should_draft(256, 100)
    assert verifier.stats.num_draft_off_steps == 1
    assert verifier.should_draft(8, 100)
    assert not verifier.should_draft(0, 100)


def test_judgements_are_reused_until_what_they_rest_on_changes():
    """`should_draft` judges a step shape once per REJUDGE_INTERVAL calls (the plain steps' ratio drifts slowly) and
    at once after anything it rests on changes: new acceptance rates turn drafting off and on again immediately."""
    verifier = AdaptiveVerifier(grid_model(roofline, query_lens=(1, 5), draft=lambda b: 1e-3), 4)
    observe_steps(verifier, 0.8)
    judged = []
    judge = verifier._judge

    def counting(*args):  # noqa: ANN002, ANN202
        judged.append(args)
        return judge(*args)

    verifier._judge = counting  # type: ignore[method-assign]
    assert all(verifier.should_draft(8, 100) for _ in range(2 * REJUDGE_INTERVAL + 1))
    assert len(judged) == 3
    assert verifier.should_draft(8, 100 + CONTEXT_BUCKET) and len(judged) == 4  # another shape: judged on its own
    observe_steps(verifier, 0.0, steps=60)
    assert not verifier.should_draft(8, 100) and len(judged) == 5
    observe_steps(verifier, 0.8, steps=60)
    assert verifier.should_draft(8, 100) and len(judged) == 6


def test_close_calls_keep_exploring_and_clear_losses_do_not():
    """Acceptance 0.5 on 10 ms plain steps: with a 4 ms drafter, drafting's best expected rate is about 1.10x plain
    decoding's, past the 5% margin: every step drafts. With a 5 ms drafter (about 1.04x), short of the margin,
    drafting is off except for exploring steps (rates learned from a few steps must be able to recover), one in
    max(EXPLORE_INTERVAL, 90): a probe's 5 ms drafter forward and 4 ms of verifying its 4 drafts cost PROBE_BUDGET
    (1%) of the time; a 20 ms one loses by far (~0.57x) and never drafts."""
    for draft_s, interval in ((4e-3, 1), (5e-3, max(EXPLORE_INTERVAL, 90)), (20e-3, None)):
        verifier = AdaptiveVerifier(grid_model(lambda b, t, c: 0.010 + 1e-3 * (t - b), query_lens=(1, 5),
                                               draft=lambda b, d=draft_s: d), 4)
        observe_steps(verifier, 0.5)
        answers = [verifier.should_draft(1, 100) for _ in range(100)]
        assert sum(answers) == (0 if interval is None else 100 // interval)
        if interval is not None:
            assert answers[interval - 1]
        assert verifier.stats.num_draft_off_steps == 100 - sum(answers)


def test_long_context_turns_speculation_off():
    """Verification tokens cost more with context (attention per query token): at 1M context neither verifying nor
    drafting pays, at short context both do."""
    model = grid_model(lambda b, q, c: 0.010 + 1e-4 * q * (1 + c / 1000), context_lens=(0, 1000, 1_000_000))
    verifier = AdaptiveVerifier(model, 4)
    assert verifier.choose([[0.8] * 4] * 4, [0] * 4) == [4] * 4
    assert verifier.choose([[0.8] * 4] * 4, [1_000_000] * 4) == [0] * 4
    observe_steps(verifier, 0.8, confidence=0.8)
    assert verifier.should_draft(4, 0)
    assert not verifier.should_draft(4, 1_000_000)


def test_observe_counts_only_reached_positions():
    """A draft after a rejection is not judged: position 1's rate comes only from requests that accepted position 0."""
    verifier = AdaptiveVerifier(grid_model(memory_bound), 3, ema=1.0)
    verifier.observe([3, 3, 2, 0], [0, 2, 2, 0], [[0.5, 0.6, 0.7], [0.9, 0.2, 0.0], [0.4, 0.4], []])
    # position 0: requests 0-2 reached it, 1 and 2 accepted; position 1: requests 1 and 2 reached it (request 0's
    # draft 1 came after a rejection), both accepted; position 2: only request 1 (request 2 verified 2), rejected.
    assert verifier.acceptance_rates == pytest.approx((2 / 3, 1.0, 0.0))
    # position 2: the mean confidence offered is 0, which gives no ratio
    assert verifier.calibration_scales == pytest.approx(((2 / 3) / 0.6, 1.0 / 0.3, 1.0))


def test_calibration_scales_overconfident_and_underconfident_drafters():
    """Confidence 0.9 accepted 45% of the time scales by 0.5; confidence 0.4 accepted 80% scales by 2 and clamps at
    1; unobserved positions borrow the last observed scale; the averages start at the drafter's own confidence (scale
    1, one step's worth) and move by `ema` per step."""
    over = AdaptiveVerifier(grid_model(memory_bound), 2)
    assert over.calibrate([0.9, 0.6]) == [0.9, 0.6]  # nothing observed: unscaled
    over.observe([1] * 20, [1] * 9 + [0] * 11, [[0.9, 0.9]] * 20)
    assert over.calibration_scales == pytest.approx((0.95, 0.95))  # (0.9 * 0.9 + 0.1 * 0.45) / 0.9: one step moves
    for _ in range(80):
        over.observe([1] * 20, [1] * 9 + [0] * 11, [[0.9, 0.9]] * 20)
    assert over.calibration_scales == pytest.approx((0.5, 0.5), abs=1e-3)
    assert over.calibrate([0.9, 0.6]) == pytest.approx([0.45, 0.3], abs=1e-3)
    assert over.calibrate([1.5, float("nan")]) == pytest.approx([0.5, 0.0], abs=1e-3)  # inputs clamped first

    under = AdaptiveVerifier(grid_model(memory_bound), 1, ema=0.5)
    under.observe([1] * 10, [1] * 8 + [0] * 2, [[0.4]] * 10)  # acceptance 0.4 (prior) -> 0.6
    assert under.calibrate([0.3]) == pytest.approx([0.45])
    under.observe([1] * 10, [1] * 8 + [0] * 2, [[0.4]] * 10)  # -> 0.7
    assert under.calibrate([0.6]) == [1.0]
    under.observe([1] * 10, [0] * 10, [[0.4]] * 10)  # -> 0.35
    assert under.acceptance_rates == pytest.approx((0.35,))
    assert under.calibration_scales == pytest.approx((0.875,))


def test_one_rejection_does_not_stop_a_position_from_being_verified():
    """A single rejected draft at position 1 lowers its scale by `ema`, not to 0: the verifier still verifies it (a
    zero scale would have stopped position 1 and every later one for good, since only verified drafts are judged)."""
    verifier = AdaptiveVerifier(grid_model(memory_bound), 3)
    verifier.observe([3], [1], [[0.8, 0.7, 0.6]])  # position 0 accepted, position 1 rejected, position 2 not reached
    assert verifier.calibration_scales[1] == pytest.approx(0.9)
    assert verifier.choose([[0.8, 0.7, 0.6]], [10]) == [3]


def test_calibration_changes_the_choice():
    """An overconfident drafter gets fewer positions once its acceptance is observed."""
    model = grid_model(lambda b, q, c: 1.0 + 0.1 * q)
    verifier = AdaptiveVerifier(model, 4)
    assert verifier.choose([[0.9] * 4, [0.9] * 4], [10, 10]) == [4, 4]
    observe_steps(verifier, 0.3, confidence=0.9)
    assert verifier.choose([[0.9] * 4, [0.9] * 4], [10, 10]) == [1, 1]


def test_stats_count_the_decisions():
    """Counters: steps decided, positions offered and verified, the last total."""
    verifier = AdaptiveVerifier(grid_model(memory_bound), 4)
    verifier.choose([[0.9] * 4, [0.9] * 2, []], [1, 1, 1])
    verifier.choose([[0.9]], [1])
    assert verifier.stats == AdaptiveStats(num_steps=2, num_offered_positions=7, num_verified_positions=7,
                                           num_draft_off_steps=0, last_total=1)


def test_scan_totals_keeps_the_smallest_best_total():
    """Ties keep the smaller total; a zero gain is never taken; the seconds must cover M = 0..len(gains)."""
    assert scan_totals([1.0, 0.5, 0.0, 0.0], [1.0] * 5, base_tokens=1) == (2, 2.5)
    assert scan_totals([1.0, 1.0], [1.0, 2.0, 3.0], base_tokens=1) == (0, 1.0)  # 1/1 = 2/2 = 3/3: keep M = 0
    assert scan_totals([], [2.0], base_tokens=2) == (0, 1.0)
    with pytest.raises(ValueError, match="step_seconds"):
        scan_totals([1.0], [1.0], base_tokens=1)


def test_verifier_validation():
    """Bad constructor arguments and mismatched inputs raise ValueError."""
    model = grid_model(memory_bound)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AdaptiveVerifier(model, 0)
    with pytest.raises(ValueError, match="ema"):
        AdaptiveVerifier(model, 2, ema=0.0)
    verifier = AdaptiveVerifier(model, 2)
    with pytest.raises(ValueError, match="context_lens"):
        verifier.choose([[0.5]], [1, 2])
    with pytest.raises(ValueError, match="num_speculative_tokens=2"):
        verifier.choose([[0.5] * 3], [1])
    with pytest.raises(ValueError, match="num_other_tokens"):
        verifier.choose([[0.5]], [1], num_other_seqs=2, num_other_tokens=1)
    with pytest.raises(ValueError, match="request 0"):
        verifier.observe([1], [2], [[0.5, 0.5]])
    with pytest.raises(ValueError, match="lengths differ"):
        verifier.observe([1], [1, 0], [[0.5]])


def test_cost_model_interpolates_exactly_on_and_between_grid_points():
    """Grid points come back as measured; a function linear in each axis is reproduced anywhere inside."""
    def linear(b: int, q: int, c: int) -> float:
        return 1e-3 + 1e-4 * b + 1e-5 * q + 1e-8 * c * b

    model = grid_model(linear, query_lens=(1, 5), context_lens=(0, 1000, 8000), batch_sizes=(1, 4, 16))
    for b, q, c in itertools.product((1, 4, 16), (1, 5), (0, 1000, 8000)):
        assert model.predict(b, b * q, c) == pytest.approx(linear(b, b * q, c), rel=1e-12)
    assert model.predict(2, 6, 500) == pytest.approx(
        (model.predict(1, 3, 500) * 2 + model.predict(4, 12, 500)) / 3, rel=1e-12)  # linear in b at 3 tokens per seq
    assert model.predict(3, 9, 4500) == pytest.approx(
        (model.predict(3, 9, 1000) + model.predict(3, 9, 8000)) / 2, rel=1e-12)
    assert model.predict_draft(0) == 0.0


def test_cost_model_monotonic_inside_and_beyond_the_grid():
    """On a monotone table, predict never decreases in batch, tokens or context, beyond the grid included; a noisy
    end segment that decreases is extended flat, not downwards; the floor keeps it positive."""
    model = grid_model(roofline, query_lens=(1, 5), context_lens=(100, 4096), batch_sizes=(1, 8, 64))
    for c in (0, 50, 100, 2000, 4096, 20_000):
        for b in (1, 2, 7, 8, 30, 64, 100, 500):
            values = [model.predict(b, t, c) for t in range(b, 8 * b + 1, max(b // 4, 1))]
            assert values == sorted(values) and values[0] > 0
        assert [model.predict(b, 3 * b, c) for b in range(1, 600, 7)] == sorted(
            model.predict(b, 3 * b, c) for b in range(1, 600, 7))
    ctx_sweep = [model.predict(16, 40, c) for c in range(0, 20_000, 250)]
    assert ctx_sweep == sorted(ctx_sweep)
    assert model.predict(64, 64 * 10, 4096) > model.predict(64, 64 * 5, 4096)  # linear past the last query length

    noisy = StepCostModel(batch_sizes=(1, 2), query_lens=(1,), context_lens=(0,), seconds=(((2.0,), (1.0,)),),
                          draft_seconds=(0.0, 0.0))
    assert noisy.predict(3, 3, 0) == noisy.predict(100, 100, 0) == 1.0
    steep = StepCostModel(batch_sizes=(1,), query_lens=(1,), context_lens=(1000, 2000), seconds=(((1e-3,),), ((1.0,),)),
                          draft_seconds=(0.0,))
    assert steep.predict(1, 1, 0) == MIN_STEP_SECONDS  # linear extrapolation would go negative


def test_cost_model_json_round_trip():
    """to_json -> json text -> from_json gives an equal model; lists given to the constructor become tuples."""
    model = grid_model(roofline, draft=lambda b: 1e-4 * b)
    back = StepCostModel.from_json(json.loads(json.dumps(model.to_json())))
    assert back == model
    lists: dict = {"batch_sizes": [1], "query_lens": [1], "context_lens": [0], "seconds": [[[1.0]]],
                   "draft_seconds": [0.5]}
    from_lists = StepCostModel(**lists)
    assert from_lists.batch_sizes == (1,) and from_lists.seconds == (((1.0,),),)


@pytest.mark.parametrize(("change", "field"), [
    ({"batch_sizes": (2, 1)}, "batch_sizes"),
    ({"batch_sizes": (0, 1)}, "batch_sizes"),
    ({"query_lens": ()}, "query_lens"),
    ({"context_lens": (-1, 5)}, "context_lens"),
    ({"seconds": (((1.0, 1.0), (1.0, 1.0)),)}, r"seconds: 1 rows"),
    ({"seconds": (((1.0, 1.0),), ((1.0, 1.0), (1.0, 1.0)))}, r"seconds\[0\]"),
    ({"seconds": (((1.0, 1.0), (1.0,)), ((1.0, 1.0), (1.0, 1.0)))}, r"seconds\[0\]\[1\]"),
    ({"seconds": (((1.0, 1.0), (1.0, 1.0)), ((1.0, 0.0), (1.0, 1.0)))}, r"seconds\[1\]\[0\]\[1\]"),
    ({"seconds": (((1.0, float("inf")), (1.0, 1.0)), ((1.0, 1.0), (1.0, 1.0)))}, r"seconds\[0\]\[0\]\[1\]"),
    ({"draft_seconds": (0.0,)}, "draft_seconds"),
    ({"draft_seconds": (0.0, -1.0)}, r"draft_seconds\[1\]"),
])
def test_cost_model_validation_names_the_field(change: dict, field: str):
    """Each malformed field raises a ValueError naming it (and the index)."""
    good = {"batch_sizes": (1, 2), "query_lens": (1, 5), "context_lens": (0, 100),
            "seconds": (((1.0, 1.0), (1.0, 1.0)), ((1.0, 1.0), (1.0, 1.0))), "draft_seconds": (0.0, 0.0)}
    with pytest.raises(ValueError, match=field):
        StepCostModel(**{**good, **change})


def test_cost_model_from_json_and_predict_validation():
    """from_json rejects missing and unknown keys and non-lists; predict rejects impossible steps."""
    data = grid_model(roofline).to_json()
    with pytest.raises(ValueError, match="seconds: missing"):
        StepCostModel.from_json({k: v for k, v in data.items() if k != "seconds"})
    with pytest.raises(ValueError, match="unknown"):
        StepCostModel.from_json({**data, "extra": 1})
    with pytest.raises(ValueError, match="query_lens: expected a list"):
        StepCostModel.from_json({**data, "query_lens": 3})
    model = StepCostModel.from_json(data)
    with pytest.raises(ValueError, match="num_tokens"):
        model.predict(4, 3, 0)
    with pytest.raises(ValueError, match="num_seqs"):
        model.predict(0, 0, 0)
    with pytest.raises(ValueError, match="context_len"):
        model.predict(1, 1, -1)


def test_measure_cost_model_takes_the_median_of_repeats():
    """Every grid point is timed `repeats` times with num_tokens = batch * query_len; the median is kept; no drafter
    callable means drafting costs nothing."""
    calls: list[tuple[int, int, int]] = []
    noise = itertools.cycle([3.0, 1.0, 2.0])

    def time_step(num_seqs: int, num_tokens: int, context_len: int) -> float:
        calls.append((num_seqs, num_tokens, context_len))
        return next(noise) * (num_tokens + context_len)

    model = measure_cost_model(time_step, batch_sizes=(1, 4), query_lens=(1, 3), context_lens=(10,))
    assert sorted(set(calls)) == [(1, 1, 10), (1, 3, 10), (4, 4, 10), (4, 12, 10)]
    assert len(calls) == 12
    assert model.seconds == (((22.0, 26.0), (28.0, 44.0)),)
    assert model.draft_seconds == (0.0, 0.0)
    drafted = measure_cost_model(time_step, batch_sizes=(1, 4), query_lens=(1,), context_lens=(0,),
                                 time_draft=lambda b: 0.5 * b, repeats=1)
    assert drafted.predict_draft(4) == 2.0
    with pytest.raises(ValueError, match="repeats"):
        measure_cost_model(time_step, batch_sizes=(1,), query_lens=(1,), context_lens=(0,), repeats=0)
    with pytest.raises(ValueError, match="batch_sizes"):
        measure_cost_model(time_step, batch_sizes=(4, 1), query_lens=(1,), context_lens=(0,))


def verify_extra(verifier: AdaptiveVerifier, extra: float) -> float:
    """The verifier's corrected price of verifying tokens whose start-up predicted extra time is `extra`."""
    ratio = verifier.cost_corrections[1]
    return verifier.verify_overhead + ratio * extra


def test_one_slow_first_verifying_step_does_not_pin_the_correction():
    """The first verifying step of a process pays one-time costs: it moves the correction by the EMA weight from the
    start-up model, not to the cap, and ordinary steps after it bring it back (2026-12-07: a ratio pinned at 8 by the
    first step kept the verifier at one position for the rest of the run)."""
    model = grid_model(lambda b, q, c: 0.010 + 1e-3 * q, draft=lambda b: 1e-4)
    verifier = AdaptiveVerifier(model, 8)
    plain, full = model.predict(1, 1, 100), model.predict(1, 9, 100)
    verifier.observe_step(1, 9, 100, plain + 1e-4 + 50 * (full - plain), num_drafting=1, verified=True)
    assert 1.5 * (full - plain) < verify_extra(verifier, full - plain) < 3 * (full - plain)  # not 8x, nor 50x
    for _ in range(30):
        verifier.observe_step(1, 9, 100, plain + 1e-4 + (full - plain), num_drafting=1, verified=True)
    assert verify_extra(verifier, full - plain) == pytest.approx(full - plain, rel=0.1)
    assert verifier.choose([[0.9] * 8], [100]) == [8]


def test_a_fixed_verification_cost_is_told_from_a_per_token_one():
    """Verifying steps that cost 3 ms more than predicted whatever they verify (1 or 8 tokens): the fit puts it in the
    fixed cost, keeping the per-token ratio near 1, so a long verification is not priced as 3 ms per token (a ratio
    alone, fitted on short verifications, made the verifier give up long ones)."""
    model = grid_model(lambda b, q, c: 0.010 + 1e-3 * q, draft=lambda b: 0.0)
    verifier = AdaptiveVerifier(model, 8)
    plain = model.predict(1, 1, 100)
    for step in range(60):
        q = 2 if step % 2 else 9
        verifier.observe_step(1, q, 100, model.predict(1, q, 100) + 3e-3, verified=True)
    assert verifier.verify_overhead == pytest.approx(3e-3, rel=0.1)
    assert verifier.cost_corrections[1] == pytest.approx(1.0, abs=0.1)
    assert verify_extra(verifier, model.predict(1, 9, 100) - plain) == pytest.approx(11e-3, rel=0.05)


def test_measured_step_times_never_fall_with_more_tokens():
    """A point timed slow (the machine busy) is capped by the cheapest point of more query tokens: verification is
    never predicted to cost less than nothing, nor a plain step more than a verifying one."""
    slow = {(1, 1): 3.6, (1, 2): 2.9, (1, 4): 3.3, (1, 8): 3.8, (2, 2): 3.0, (2, 4): 3.0, (2, 8): 2.9, (2, 16): 4.0}
    model = measure_cost_model(lambda b, t, c: slow[(b, t)], batch_sizes=(1, 2), query_lens=(1, 2, 4, 8),
                               context_lens=(0,), repeats=1)
    assert model.seconds == (((2.9, 2.9, 3.3, 3.8), (2.9, 2.9, 2.9, 4.0)),)


def test_real_step_times_correct_the_cost_model():
    """Verification that really costs more than the start-up model said stops being chosen: after verifying steps
    whose verification took 20x the predicted time, a choice that paid no longer does; plain steps as predicted leave
    the plain part alone."""
    verifier = AdaptiveVerifier(grid_model(lambda b, q, c: 0.010 + 1e-3 * q, draft=lambda b: 1e-4), 8)
    confident = [[0.6] * 8]
    assert verifier.choose(confident, [100]) == [3]  # 0.6, 0.36, 0.22 per 1 ms each; 0.13 does not pay
    assert verifier.cost_corrections == (1.0, 1.0)
    model = verifier.cost_model
    plain, full = model.predict(1, 1, 100), model.predict(1, 9, 100)
    for _ in range(50):
        verifier.observe_step(1, 1, 100, plain)  # plain steps as predicted
        verifier.observe_step(1, 9, 100, plain + 20 * (full - plain), num_drafting=0, verified=True)
    p, _ = verifier.cost_corrections
    assert p == pytest.approx(1.0)
    # Every observation verified 8 tokens: their 20x is priced in (to within the per-observation cap of 8x the
    # step), as a fixed cost, the fit's choice when the verified sizes do not vary.
    assert verify_extra(verifier, full - plain) > 0.9 * min(20 * (full - plain), 8 * full)
    assert verifier.choose(confident, [100]) == [0]


def test_prefill_steps_do_not_correct_the_cost_model():
    """A step with a prefill chunk is far outside the start-up grid (1 to k + 1 tokens a row): its time says nothing
    of decode or verify costs, so the engine's hook does not feed it to the verifier (a 200-token prefill once
    clamped the plain ratio to 1/4, after which no verification ever paid); a decode step does correct it."""
    from deltaserve.engine.hooks import ProposerHook
    from deltaserve.scheduler.output import ScheduledChunk, SchedulerOutput

    verifier = AdaptiveVerifier(grid_model(lambda b, q, c: 0.010 + 1e-3 * q), 4)
    hook = ProposerHook(None, None, {}, verifier=verifier)  # type: ignore[arg-type]  # these calls need neither

    def chunk(tokens: int) -> ScheduledChunk:
        return ScheduledChunk(request_id="r", new_token_ids=[1] * tokens, num_computed_tokens=100, state_slot=0,
                              block_ids=[0])

    def step(out: SchedulerOutput, seconds: float) -> None:  # what the engine calls for a step
        hook.observe_step(hook.after_schedule(out), seconds)

    step(SchedulerOutput(chunks=[chunk(200)]), 0.05)
    assert verifier.cost_corrections == (1.0, 1.0)
    step(SchedulerOutput(chunks=[chunk(1)]), 0.022)  # twice the predicted 11 ms
    assert verifier.cost_corrections[0] == pytest.approx(1.1)  # from 1 (the model) by the EMA weight 0.1
