"""`deltaserve bench replay` / `followup`: trace scaling, theoretical maximum, block mapping, small end-to-end runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from deltaserve.bench import followup
from deltaserve.bench import trace_replay as tr
from deltaserve.bench.trace_replay import TraceRequest

REAL_TRACE = Path(tr.DEFAULT_TRACE)
needs_trace = pytest.mark.skipif(not REAL_TRACE.exists(), reason="the Mooncake trace is not available here")


pytestmark = pytest.mark.usefixtures("one_thread")


def _row(ts: int, inp: int, out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids}


def _req(inp: int, ids: tuple[int, ...], out: int = 1) -> TraceRequest:
    return TraceRequest(arrival_s=0.0, input_len=inp, output_len=out, hash_ids=ids)


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_and_scale_trace(tmp_path):
    """Lengths are divided rounding up (the block count is kept), outputs capped, long prompts cut with their ids."""
    rows = [_row(1000, 1100, 40, [0, 1, 2]), _row(1500, 512, 5000, [0]), _row(3000, 2000, 200, [0, 3, 4, 5])]
    path = _write_trace(tmp_path / "t.jsonl", rows)
    assert tr.read_trace(path) == rows and tr.read_trace(path, 2) == rows[:2]
    reqs = tr.scale_trace(rows, token_scale=16, time_scale=2.0, max_output_len=8, max_model_len=100)
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 1.0]  # rebased to the first row, then compressed
    assert [(r.input_len, r.output_len) for r in reqs] == [(69, 3), (32, 8), (92, 8)]  # 125 cut to 100 - 8
    assert [r.hash_ids for r in reqs] == [(0, 1, 2), (0,), (0, 3, 4)]  # 92 tokens = 3 blocks of 32
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_len / 32)
    with pytest.raises(ValueError, match="too few hash_ids"):
        tr.scale_trace([_row(0, 600, 1, [0])], token_scale=16, time_scale=1, max_output_len=4, max_model_len=100)
    with pytest.raises(ValueError, match="token_scale"):
        tr.ReplayBenchArgs(token_scale=3)


@needs_trace
def test_scaled_real_trace_keeps_block_counts():
    """On the real trace head, every scaled request keeps one id per (partial) scaled block."""
    reqs = tr.scale_trace(tr.read_trace(REAL_TRACE, 40), token_scale=16, time_scale=1, max_output_len=32,
                          max_model_len=4096)
    assert len(reqs) == 40 and all(r.input_len + r.output_len <= 4096 for r in reqs)
    assert all(len(r.hash_ids) == math.ceil(r.input_len / 32) for r in reqs)


def test_theoretical_hits_on_a_mini_trace():
    """Longest previously seen leading chain, in the tokens an earlier prompt really had, leaving one to compute."""
    reqs = [
        _req(12, (0, 1, 2)),     # nothing seen yet
        _req(12, (0, 1, 3)),     # (0, 1) seen: 2 blocks
        _req(14, (0, 1, 2, 4)),  # (0, 1, 2) seen: 3 blocks
        _req(12, (0, 1, 2)),     # a repeat: everything but the last token
        _req(8, (5, 1)),         # id 1 after a different first block is a different prefix
        _req(5, (0, 7)),         # block 7 only partially (1 token)
        _req(12, (0, 7, 8)),     # (0, 7) seen, but only 5 of its tokens existed
    ]
    assert tr.theoretical_hits(reqs, block_tokens=4) == [0, 8, 12, 11, 0, 4, 5]


def test_select_sessions_keeps_conversations():
    """Requests linked by a >= 2-block shared prefix are taken whole, in trace order; 1-block sharing is no link."""
    rows = [_row(0, 1500, 1, [0, 1, 2]), _row(1, 1000, 1, [0, 3]), _row(2, 1100, 1, [0, 1, 4]),
            _row(3, 1000, 1, [0, 5]), _row(4, 1500, 1, [0, 3, 6]), _row(5, 2000, 1, [0, 1, 4, 7])]
    picked = tr.select_sessions(rows, num_requests=10)
    assert [r["timestamp"] for r in picked] == [0, 1, 2, 4, 5]
    assert [r["timestamp"] for r in tr.select_sessions(rows, num_requests=3)] == [0, 2, 5]


def test_block_mapping_keeps_sharing_structure():
    """Same id -> same tokens, different ids -> different tokens, all below the special tokens, seeded."""
    reqs = [_req(40, (0, 1, 2)), _req(45, (0, 1, 3)), _req(17, (4, 1))]
    a, b, c = tr.build_prompts(reqs, block_tokens=16, vocab_size=1024, seed=0)
    assert [len(p) for p in (a, b, c)] == [40, 45, 17]
    assert a[:32] == b[:32] and a[32:40] != b[32:40]
    assert c[:16] != a[:16] and c[16:17] == a[16:17]  # the tokens of id 1 are fixed; its KV would differ by context
    assert all(0 <= t < 1024 - 32 for p in (a, b, c) for t in p)
    assert tr.build_prompts(reqs, 16, 1024, seed=0)[0] == a and tr.build_prompts(reqs, 16, 1024, seed=1)[0] != a
    assert tr.block_token_ids(7, 16, 1024, 0) == tr.block_token_ids(7, 16, 1024, 0)


@needs_trace
def test_theoretical_maximum_matches_the_trace_readme():
    """Unscaled, the whole conversation trace's infinite-cache hit ratio is the README's 37.4%."""
    reqs = tr.scale_trace(tr.read_trace(REAL_TRACE), token_scale=1, time_scale=1, max_output_len=1 << 20,
                          max_model_len=1 << 30)
    ratio = sum(tr.theoretical_hits(reqs, 512)) / sum(r.input_len for r in reqs)
    assert ratio == pytest.approx(0.374, abs=0.001)


def test_replay_end_to_end(tiny_dir, tmp_path, capsys):
    """A 6-request replay reports the metrics of both runs; hits never exceed the theoretical maximum."""
    rows = [_row(0, 1536, 128, [0, 1, 2]), _row(10, 1200, 64, [0, 3, 4]), _row(500, 2048, 128, [0, 1, 2, 5]),
            _row(600, 1300, 64, [0, 3, 4]), _row(600, 700, 128, [0, 6]), _row(900, 2500, 64, [0, 1, 2, 5, 7])]
    args = tr.ReplayBenchArgs(model=str(tiny_dir("base")), trace=str(_write_trace(tmp_path / "t.jsonl", rows)),
                              select="head", num_requests=6, token_scale=64, block_size=8, max_output_len=2,
                              cache_memory="64MiB", result_file=str(tmp_path / "r.json"))
    res = tr.run(args)
    trace = res["trace"]
    assert trace["num_requests"] == 6 and trace["block_tokens"] == 8 and trace["state_checkpoint_interval"] == 8
    assert trace["theoretical_hit_tokens"] == 0 + 8 + 24 + 19 + 8 + 32  # request 1 had only 19 tokens of (0, 3, 4)
    for key in ("caching_on", "caching_off"):
        run = res[key]
        assert run["prompt_tokens"] == trace["prompt_tokens"] and len(run["ttfts_ms"]) == 6
        assert 0 < run["ttft_p50_ms"] <= run["ttft_p90_ms"]
        assert 0 <= run["hit_tokens"] <= trace["theoretical_hit_tokens"]
    assert res["caching_off"]["hit_tokens"] == 0
    assert json.loads((tmp_path / "r.json").read_text())["trace"] == trace
    assert "theoretical max" in capsys.readouterr().out


def test_followup_end_to_end(tiny_dir, capsys):
    """The follow-up benchmark runs cold and warm and reports their TTFT ratio."""
    res = followup.run_followup(followup.FollowupBenchArgs(model=str(tiny_dir("base")), prompt_len=96, output_len=2,
                                               state_checkpoint_interval=32, cache_memory="64MiB"))
    assert res["num_shared_tokens"] == 86 and res["reusable_tokens"] == 64
    assert res["ttft_ratio"] > 0 and res["cold"]["cached_tokens"] == 0
    assert res["warm"]["cached_tokens"] <= 86
    assert "warm / cold TTFT" in capsys.readouterr().out


def test_evicted_followup_rehydrates_from_the_host_tier(tiny_dir, capsys):
    """With other prompts evicting the first from a small device cache, the follow-up recomputes without a host tier
    and hits with one, with the host tier's copies beside the forward and before it alike."""
    res = followup.run_followup(followup.FollowupBenchArgs(
        model=str(tiny_dir("base")), prompt_len=96, output_len=2, state_checkpoint_interval=32, shared=0.9,
        evict_tokens=3000, num_blocks=80, host_cache_memory="16MiB", compare_copy_overlap=True))
    assert res["recomputed"]["cached_tokens"] == 0 and res["rehydrated"]["cached_tokens"] == 80  # last full block
    assert res["rehydrated"]["prefix_stats"]["host_hit_tokens"] == 80
    for mode in ("beside", "before"):
        run = res[f"rehydrated, copies {mode} the forward"]
        assert run["cached_tokens"] == 80 and run["host_copy_s"] > 0
    assert res["overlap_ratio"] > 0
    out = capsys.readouterr().out
    assert "rehydrated / recomputed TTFT" in out and "copies beside / before the forward" in out


def test_cli_registers_replay_and_followup():
    """`deltaserve bench replay|followup` parse into the benchmark dataclasses."""
    from deltaserve.entrypoints.cli import build_parser
    from deltaserve.utils.cli_args import dataclass_from_args

    ns = build_parser().parse_args(["bench", "replay", "--num-requests", "3", "--no-baseline", "--select", "head"])
    assert dataclass_from_args(tr.ReplayBenchArgs, ns) == tr.ReplayBenchArgs(num_requests=3, baseline=False,
                                                                            select="head")
    ns = build_parser().parse_args(["bench", "followup", "--shared", "0.8"])
    assert dataclass_from_args(followup.FollowupBenchArgs, ns).shared == 0.8
