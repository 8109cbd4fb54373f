"""`bench serve` workloads: random / prefix-sharing prompts, Mooncake replay's sharing structure, agentic sessions,
and the configuration's validation and vLLM flag names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from deltaserve.bench import datasets as ds
from deltaserve.bench import trace_replay as tr
from deltaserve.bench.serve_config import ServeBenchConfig
from deltaserve.text.tokenizer import Tokenizer

REAL_TRACE = Path(tr.DEFAULT_TRACE)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir("base"))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_random_prompts_have_exact_lengths_and_ordinary_ids(tokenizer):
    """Fixed lengths (or within the range ratio), a shared prefix, ids below the special tokens, seeded."""
    bound = ds.ordinary_id_bound(tokenizer)
    assert bound == min(tokenizer.special_tokens.values()) <= tokenizer.vocab_size
    reqs = ds.random_requests(6, input_len=40, output_len=7, prefix_len=8, id_bound=bound, seed=3)
    assert [(len(r.prompt), r.prompt_len, r.output_len) for r in reqs] == [(48, 48, 7)] * 6
    assert all(r.prompt[:8] == reqs[0].prompt[:8] for r in reqs) and reqs[0].prompt[8:] != reqs[1].prompt[8:]
    assert all(0 <= t < bound for r in reqs for t in r.prompt)
    assert ds.random_requests(6, input_len=40, output_len=7, prefix_len=8, id_bound=bound, seed=3) == reqs
    ranged = ds.random_requests(200, input_len=100, output_len=10, range_ratio=0.5, id_bound=bound, seed=0)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 20
    # vLLM's bounds: floor of the low end, ceil of the high end (7 * 1.1 = 7.7 -> 8 may be drawn, 7 * 0.9 -> 6).
    odd = ds.random_requests(400, input_len=7, output_len=7, range_ratio=0.1, id_bound=bound, seed=1)
    assert {r.prompt_len for r in odd} == {6, 7, 8}


def test_prefix_repetition_shares_each_prefix_evenly():
    """num_prefixes distinct prefixes, each shared by n / num_prefixes requests with their own suffixes."""
    reqs = ds.prefix_repetition_requests(12, prefix_len=16, suffix_len=8, num_prefixes=3, output_len=4,
                                         id_bound=500, seed=0)
    groups: dict[tuple[int, ...], int] = {}
    for r in reqs:
        groups[tuple(r.prompt[:16])] = groups.get(tuple(r.prompt[:16]), 0) + 1
        assert r.prompt_len == len(r.prompt) == 24 and r.output_len == 4
    assert sorted(groups.values()) == [4, 4, 4]
    assert len({tuple(r.prompt[16:]) for r in reqs}) == 12


def _assert_sharing_matches_hash_ids(reqs: list[ds.SampleRequest], block: int) -> None:
    """Two prompts share exactly the leading blocks their hash_ids share: the token prefix they have in common
    covers those blocks (or the shorter prompt) and ends within the first differing block."""
    for i, a in enumerate(reqs):
        assert len(a.prompt) == a.prompt_len and len(a.hash_ids) == math.ceil(a.prompt_len / block)
        for b in reqs[:i]:
            k = _common_prefix(list(a.hash_ids), list(b.hash_ids))
            common = _common_prefix(a.prompt, b.prompt)
            assert common >= min(k * block, len(a.prompt), len(b.prompt))
            if k < min(len(a.hash_ids), len(b.hash_ids)):
                assert common < k * block + 4  # the first differing blocks differ from (nearly) their first token


def _ideal_hits_from_tokens(reqs: list[ds.SampleRequest], block: int) -> int:
    """The infinite-cache hit tokens recomputed from the prompts alone, at block granularity."""
    total = 0
    for i, a in enumerate(reqs):
        best = 0
        for b in reqs[:i]:
            common = _common_prefix(a.prompt, b.prompt)
            best = max(best, common if common in (len(a.prompt), len(b.prompt)) else common // block * block)
        total += max(0, min(best, len(a.prompt) - 1))
    return total


def test_mooncake_replay_keeps_sharing_structure_of_a_crafted_trace(tmp_path):
    """Same leading hash ids -> same tokens, different -> different; the ideal hit rate from the tokens equals the
    trace's theoretical one; timestamps are scaled."""
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
            {"timestamp": 400, "input_length": 1300, "output_length": 5, "hash_ids": [0, 1, 3]},
            {"timestamp": 1000, "input_length": 2000, "output_length": 9, "hash_ids": [0, 1, 2, 4]},
            {"timestamp": 1500, "input_length": 600, "output_length": 9, "hash_ids": [5, 6]},
            {"timestamp": 2000, "input_length": 1024, "output_length": 9, "hash_ids": [0, 1]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs, info = ds.mooncake_requests(str(path), 5, select="head", token_scale=16, time_scale=2.0, max_output_len=8,
                                      max_model_len=4096, id_bound=900, seed=0)
    assert [r.arrival_s for r in reqs] == [0.0, 0.2, 0.5, 0.75, 1.0]
    assert [r.output_len for r in reqs] == [4, 1, 1, 1, 1]
    assert [r.prompt_len for r in reqs] == [69, 82, 125, 38, 64]
    assert all(0 <= t < 900 for r in reqs for t in r.prompt)
    _assert_sharing_matches_hash_ids(reqs, 32)
    assert reqs[0].prompt[:64] == reqs[1].prompt[:64] == reqs[4].prompt and reqs[0].prompt[64:] == \
        reqs[2].prompt[64:69]
    assert info["trace_theoretical_hit_tokens"] == _ideal_hits_from_tokens(reqs, 32) == 0 + 64 + 69 + 0 + 63


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the Mooncake trace is not available here")
def test_mooncake_replay_of_real_trace_slice_reproduces_its_sharing():
    """40 requests of real conversations: prompts share exactly what their hash_ids share, and the ideal hit
    rate recomputed from the tokens matches the trace's theoretical maximum."""
    reqs, info = ds.mooncake_requests(str(REAL_TRACE), 40, select="sessions", token_scale=16, time_scale=1.0,
                                      max_output_len=32, max_model_len=1 << 20, id_bound=150_000, seed=0)
    assert len(reqs) == 40 and info["trace_block_tokens"] == 32
    _assert_sharing_matches_hash_ids(reqs, 32)
    assert _ideal_hits_from_tokens(reqs, 32) == info["trace_theoretical_hit_tokens"]
    assert info["trace_theoretical_hit_rate"] > 0.3  # these conversations do share long prefixes


def test_mooncake_rejects_bad_scales(tmp_path):
    with pytest.raises(ValueError, match="--trace-token-scale"):
        ds.mooncake_requests("x", 1, select="head", token_scale=3, time_scale=1, max_output_len=None,
                             max_model_len=100, id_bound=10, seed=0)
    with pytest.raises(FileNotFoundError):
        ds.mooncake_requests(str(tmp_path / "missing.jsonl"), 1, select="head", token_scale=16, time_scale=1,
                             max_output_len=None, max_model_len=100, id_bound=10, seed=0)


def test_agentic_sessions_share_the_system_prompt(tokenizer):
    """ceil(n / turns) sessions (the last shorter), one shared system prompt, texts of about the asked length."""
    sessions = ds.agentic_sessions(10, turns=4, system_len=100, user_len=30, tool_len=50, output_len=8,
                                   tokenizer=tokenizer, seed=0)
    assert [s.num_turns for s in sessions] == [4, 4, 2]
    assert len({s.system for s in sessions}) == 1 and len({s.user for s in sessions}) == 3
    n = len(tokenizer.encode(sessions[0].tool_results[0]))
    assert 50 <= n <= 60
    assert sum(s.num_turns for s in sessions) == 10


def test_config_validation_gives_clear_errors():
    """Unknown dataset, non-positive concurrency, rate or prompts, mismatched backend: ValueError naming the flag."""
    cases = [({"dataset_name": "sharegpt"}, "unknown --dataset-name 'sharegpt'"),
             ({"max_concurrency": 0}, "--max-concurrency must be a positive integer"),
             ({"max_concurrency": -3}, "--max-concurrency"), ({"request_rate": 0.0}, "--request-rate"),
             ({"num_prompts": 0}, "--num-prompts"), ({"burstiness": 0.0}, "--burstiness"),
             ({"dataset_name": "agentic", "backend": "openai"}, "needs --backend openai-chat"),
             ({"goodput": ["ttft"]}, "--goodput"), ({"random_range_ratio": 1.0}, "--random-range-ratio"),
             ({"dataset_path": "t.jsonl"}, "--dataset-path is a trace file for mooncake"),
             ({"logprobs": -1}, "--logprobs"),
             ({"ramp_up_strategy": "linear", "ramp_up_start_rps": 1}, "needs both"),
             ({"ramp_up_strategy": "linear", "ramp_up_start_rps": 1, "ramp_up_end_rps": 5, "request_rate": 2.0},
              "remove --request-rate"),
             ({"ramp_up_strategy": "linear", "ramp_up_start_rps": 0, "ramp_up_end_rps": 5}, "0 < start <= end"),
             ({"ramp_up_start_rps": 1}, "need --ramp-up-strategy")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ServeBenchConfig(**kwargs)
    cfg = ServeBenchConfig(dataset_name="agentic", port=9)
    assert (cfg.backend_name, cfg.endpoint_path, cfg.url) == ("openai-chat", "/v1/chat/completions",
                                                              "http://127.0.0.1:9")
    assert ServeBenchConfig(backend="vllm").backend_name == "openai"  # vLLM's name for its completions API
    assert ServeBenchConfig(backend="openai-chat").endpoint_path == "/v1/chat/completions"  # random prompts as text
    ramp = ServeBenchConfig(ramp_up_strategy="exponential", ramp_up_start_rps=1, ramp_up_end_rps=8)
    assert ramp.rate_label == "ramp-up-exponential-1qps-8qps"
    assert ServeBenchConfig(dataset_name="mooncake").uses_timestamps
    assert not ServeBenchConfig(dataset_name="mooncake", self_timed=False).uses_timestamps


def test_cli_uses_vllm_flag_names():
    """`deltaserve bench serve` accepts vllm bench serve's flags with the same meaning."""
    from deltaserve.bench.serve_config import config_from_args
    from deltaserve.entrypoints.cli import build_parser
    from deltaserve.utils.cli_args import dashes_in_flags

    argv = ["bench", "serve", "--base-url", "http://h:1", "--model", "m", "--dataset-name", "random",
            "--num-prompts", "5", "--random-input-len", "8192", "--random-output-len", "1000", "--max-concurrency", "4",
            "--request-rate", "2.5", "--burstiness", "0.5", "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", "50,90", "--goodput", "ttft:500", "tpot:50", "--save-result", "--result-dir", "r",
            "--result-filename", "f.json", "--ignore-eos", "--extra-body", '{"top_k": 5}']
    cfg = config_from_args(ServeBenchConfig, build_parser().parse_args(argv))
    assert (cfg.num_prompts, cfg.random_input_len, cfg.random_output_len, cfg.max_concurrency) == (5, 8192, 1000, 4)
    assert (cfg.request_rate, cfg.burstiness, cfg.goodput) == (2.5, 0.5, ["ttft:500", "tpot:50"])
    assert cfg.save_result and cfg.ignore_eos and cfg.extra_body == {"top_k": 5} and cfg.result_dir == "r"
    assert build_parser().parse_args(["bench", "serve"]).request_rate == float("inf")
    # vLLM's general --input-len / --output-len, its underscore spellings, and its sampling flags.
    argv = ["bench", "serve", "--input_len", "64", "--output-len", "9", "--num_prompts=3", "--min-p", "0.1",
            "--frequency_penalty", "0.5", "--presence-penalty", "0.2", "--repetition-penalty", "1.1", "--logprobs", "2",
            "--append-result", "--insecure", "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1",
            "--ramp-up-end-rps", "4", "--trust-remote-code"]
    cfg = config_from_args(ServeBenchConfig, build_parser().parse_args(dashes_in_flags(argv)))
    assert (cfg.random_input_len, cfg.random_output_len, cfg.num_prompts) == (64, 9, 3)
    assert (cfg.min_p, cfg.frequency_penalty, cfg.presence_penalty, cfg.repetition_penalty) == (0.1, 0.5, 0.2, 1.1)
    assert cfg.logprobs == 2 and cfg.append_result and cfg.insecure and cfg.trust_remote_code
    assert (cfg.ramp_up_strategy, cfg.ramp_up_start_rps, cfg.ramp_up_end_rps) == ("linear", 1, 4)
    assert dashes_in_flags(["--a_b=c_d", "x_y", "--", "--e_f"]) == ["--a-b=c_d", "x_y", "--", "--e_f"]
