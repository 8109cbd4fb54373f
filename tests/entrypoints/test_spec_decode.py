"""Speculative decoding end to end with the n-gram proposer, on the embedded (trained) model, whose greedy output
continues a repetitive prompt's pattern: `LLM` outputs equal plain decoding (greedy and seeded) while proposals
are accepted; `--speculative-config` errors are one line and exit code 2; the server's /metrics shows vLLM's
spec-decode counters after a request."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.default_model import default_model_dir
from tests.entrypoints.server_fixture import start_server, stop_server

PROMPT = "red green blue red green blue red green blue red green blue red green blue red green"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_ngram_outputs_equal_plain_decoding_and_proposals_are_accepted():
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)]
    plain = LLM(max_num_seqs=4).generate([PROMPT, PROMPT], params)
    llm = LLM(max_num_seqs=4, speculative_config=NGRAM)
    spec = llm.generate([PROMPT, PROMPT], params)
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == 16
    stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0
    assert 0 < stats.spec_num_drafts and stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_num_draft_tokens <= 3 * stats.spec_num_drafts
    per_pos = stats.spec_accepted_per_pos
    assert len(per_pos) <= 3 and sum(per_pos) == stats.spec_num_accepted_tokens
    assert list(per_pos) == sorted(per_pos, reverse=True)  # token j is accepted only after tokens 0..j-1


def test_llm_rejects_a_bad_speculative_config_before_loading():
    with pytest.raises(ValueError, match=r"^speculative_config.num_speculative_tokens must be an integer in 1\.\.16"):
        LLM(model="/nonexistent", speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("command, config, needle", [
    (("generate", "--prompt", "x"), '{"method": "draft", "num_speculative_tokens": 3}',
     "speculative_config.method must be one of 'ngram', 'draft_model', 'dspark', 'dflash', got 'draft'"),
    (("serve",), '{"method": "ngram", "num_speculative_tokens": 99}',
     "speculative_config.num_speculative_tokens must be an integer in 1..16, got 99"),
    (("bench", "offline"), '{"method": "ngram"', "speculative_config is not valid JSON"),
])
def test_cli_bad_speculative_config_is_a_one_line_error(command, config, needle):
    res = run_cli(*command, "--speculative-config", config)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len([line for line in res.stderr.splitlines() if "error" in line]) == 1, res.stderr


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    live = start_server(default_model_dir(), tmp_path_factory.mktemp("spec-server"), "--max-model-len", "1024",
                        "--speculative-config", json.dumps(NGRAM))
    yield live
    stop_server(live)


def test_server_metrics_show_spec_decode_counters(spec_server):
    assert spec_server.metric("spec_decode_num_drafts_total") == 0
    resp = httpx.post(f"{spec_server.url}/v1/completions", headers=spec_server.headers(), timeout=120,
                      json={"model": spec_server.model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 24
    drafts = spec_server.metric("spec_decode_num_drafts_total")
    proposed = spec_server.metric("spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= proposed <= 3 * drafts
    text = httpx.get(f"{spec_server.url}/metrics", timeout=10).text
    per_pos = {line.split('position="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines()
               if line.startswith("deltaserve:spec_decode_num_accepted_tokens_per_pos_total{")}
    assert per_pos["0"] > 0 and sum(per_pos.values()) == accepted
