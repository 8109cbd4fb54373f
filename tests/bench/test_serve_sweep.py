"""`bench sweep`'s admission rule and bisection, on synthetic run results (no server)."""

from __future__ import annotations

import pytest

from deltaserve.bench.sweep import SweepConfig, admitted, next_probe, passes


def _point(p10: float, ttft_p90: float, failed: int = 0) -> dict:
    return {"completed": 4, "failed": failed, "p10_per_user_decode_tok_s": p10, "p90_ttft_ms": ttft_p90}


def test_admission_needs_both_criteria_and_no_failures():
    """A run passes when decode p10 >= floor and TTFT p90 <= bound, with no failed request."""
    sweep = SweepConfig(min_user_decode_tok_s=20, max_ttft_p90_ms=500)
    assert passes(_point(20, 500), sweep)
    assert not passes(_point(19.9, 100), sweep)
    assert not passes(_point(50, 501), sweep)
    assert not passes(_point(50, 100, failed=1), sweep)
    assert passes(_point(1, 10_000), SweepConfig(min_user_decode_tok_s=None, max_ttft_p90_ms=None))


def test_bisection_between_largest_pass_and_smallest_fail():
    """Probe midway until passing and failing levels are adjacent; the verdict is the largest passing level."""
    verdicts = {1: True, 4: True, 16: False, 64: False}
    assert next_probe(verdicts) == 10
    verdicts[10] = False
    assert next_probe(verdicts) == 7
    verdicts[7] = True
    assert next_probe(verdicts) == 8
    verdicts[8] = True
    assert next_probe(verdicts) == 9
    verdicts[9] = False
    assert next_probe(verdicts) is None
    assert admitted(verdicts) == {"max_admitted_concurrency": 8, "smallest_failing_concurrency": 9, "exact": True,
                                  "upper_bound_tested": True}


def test_all_pass_or_all_fail():
    """All passing: a lower bound (nothing to bisect); all failing from 1: nothing admitted; failing from 4: bisect
    below it."""
    assert next_probe({1: True, 4: True}) is None
    assert admitted({1: True, 4: True})["upper_bound_tested"] is False
    assert admitted({1: False, 4: False})["max_admitted_concurrency"] == 0
    assert next_probe({1: False}) is None
    assert next_probe({4: False, 16: False}) == 2


def test_sweep_config_checks_levels():
    assert SweepConfig(concurrencies="16, 1,4,4").levels == [1, 4, 16]
    for bad in ("0,4", "a", ""):
        with pytest.raises(ValueError, match="--concurrencies"):
            SweepConfig(concurrencies=bad)
