"""`deltaserve bench serve` / `sweep` against a live tiny server: JSON with vLLM's keys, PNG plots, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.bench.serve import load_tokenizer
from deltaserve.bench.serve_config import ServeBenchConfig
from deltaserve.entrypoints.cli import main
from tests.entrypoints.server_fixture import API_KEY, free_port, start_server, stop_server

VLLM_KEYS = ("date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
             "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
             "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
             "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    live = start_server(tiny_dir("base"), tmp_path_factory.mktemp("bench-serve"))
    yield live
    stop_server(live)


def _bench(server, model_dir: Path, *args: str) -> int:
    return main(["--log-level", "WARNING", "bench", *args, "--base-url", server.url, "--model", str(model_dir),
                 "--header", f"Authorization=Bearer {API_KEY}", "--disable-tqdm"])


def test_serve_random_writes_vllm_json_and_png(server, tiny_dir, tmp_path, capsys):
    """A short random run completes every request with exact lengths; the JSON has vLLM's keys plus ours and the
    configuration; a TTFT/ITL PNG is written beside it; the console shows vLLM's table."""
    rc = _bench(server, tiny_dir("base"), "serve", "--num-prompts", "6", "--random-input-len", "32",
                "--random-output-len", "4", "--max-concurrency", "3", "--goodput", "ttft:60000",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
                "--result-dir", str(tmp_path), "--result-filename", "run.json")
    assert rc == 0
    res = json.loads((tmp_path / "run.json").read_text())
    assert all(k in res for k in VLLM_KEYS), [k for k in VLLM_KEYS if k not in res]
    assert (res["completed"], res["failed"]) == (6, 0)
    assert (res["total_input_tokens"], res["total_output_tokens"]) == (6 * 32, 6 * 4)
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert 0 < res["median_ttft_ms"] <= res["p99_ttft_ms"] and res["p50_ttft_ms"] == res["median_ttft_ms"]
    assert res["max_concurrent_requests"] <= 3 and res["max_concurrency"] == 3
    assert res["p10_per_user_decode_tok_s"] > 0 and res["served_model_name"] == "tiny"
    assert res["config"]["random_input_len"] == 32 and "ttfts" not in res  # per-request arrays need --save-detailed
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 E2EL (ms):" in out


def test_serve_agentic_and_mooncake(server, tiny_dir, tmp_path):
    """Multi-turn chat sessions with tools run turn by turn; a crafted trace replays with its theoretical hit rate."""
    rc = _bench(server, tiny_dir("base"), "serve", "--dataset-name", "agentic", "--num-prompts", "4",
                "--agentic-turns", "2", "--agentic-system-len", "48", "--agentic-user-len", "16",
                "--agentic-tool-len", "16", "--agentic-output-len", "3", "--max-concurrency", "2", "--save-result",
                "--save-detailed", "--no-plots", "--result-dir", str(tmp_path), "--result-filename", "agentic.json")
    assert rc == 0
    res = json.loads((tmp_path / "agentic.json").read_text())
    assert (res["completed"], res["agentic_sessions"], res["backend"]) == (4, 2, "openai-chat")
    lens = res["input_lens"]
    assert lens[1] > lens[0] and lens[3] > lens[2]  # the second turn carries the first, its reply and a tool result
    rows = [{"timestamp": 20 * i, "input_length": 600, "output_length": 20, "hash_ids": [0, 1 + i % 2]}
            for i in range(4)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = _bench(server, tiny_dir("base"), "serve", "--dataset-name", "mooncake", "--dataset-path", str(trace),
                "--num-prompts", "4", "--trace-time-scale", "10", "--save-result", "--no-plots", "--result-dir",
                str(tmp_path), "--result-filename", "trace.json")
    assert rc == 0
    res = json.loads((tmp_path / "trace.json").read_text())
    assert res["completed"] == 4 and res["total_input_tokens"] == 4 * 38 and res["total_output_tokens"] == 4 * 2
    assert res["trace_theoretical_hit_tokens"] == 32 + 37 + 37


def test_sweep_runs_each_concurrency_and_searches_admission(server, tiny_dir, tmp_path, capsys):
    """Every listed concurrency runs; with a bound everything meets, the admitted level is the largest tested
    (a lower bound); the sweep JSON and the throughput-vs-speed PNG are written."""
    rc = _bench(server, tiny_dir("base"), "sweep", "--concurrencies", "1,2", "--prompts-per-concurrency", "1",
                "--min-num-prompts", "2", "--random-input-len", "16", "--random-output-len", "3",
                "--max-ttft-p90-ms", "600000", "--save-result", "--label", "sw", "--result-dir", str(tmp_path))
    assert rc == 0
    summary = json.loads(next(tmp_path.glob("sw-random-*.json")).read_text())
    assert [p["max_concurrency"] for p in summary["points"]] == [1, 2]
    assert [p["completed"] for p in summary["points"]] == [2, 2] and all(p["passes"] for p in summary["points"])
    assert summary["admission"]["max_admitted_concurrency"] == 2
    assert not summary["admission"]["upper_bound_tested"]
    assert next(tmp_path.glob("sw-random-*.png")).read_bytes()[:8] == PNG_MAGIC
    assert "Concurrency Sweep" in capsys.readouterr().out


def test_bad_arguments_give_clear_errors(tiny_dir, capsys):
    """Unknown dataset, unreachable URL, non-positive concurrency, no tokenizer: exit code 2 with a message."""
    model = str(tiny_dir("base"))
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--model", model, "--dataset-name", "sharegpt"])
    assert exc.value.code == 2 and "invalid choice: 'sharegpt'" in capsys.readouterr().err
    port = free_port()
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", model,
                 "--ready-check-timeout-sec", "0"]) == 2
    assert f"cannot reach the server at http://127.0.0.1:{port}" in capsys.readouterr().err
    for argv, message in ((["serve", "--max-concurrency", "0"], "--max-concurrency must be a positive integer"),
                          (["serve", "--max-concurrency", "-2"], "--max-concurrency must be a positive integer"),
                          (["sweep", "--concurrencies", "0,4"], "--concurrencies '0,4': expected positive integers"),
                          (["serve", "--request-rate", "0"], "--request-rate must be > 0")):
        assert main(["bench", *argv, "--model", model]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="pass --tokenizer DIR"):  # a served model whose directory is elsewhere
        load_tokenizer(ServeBenchConfig(model="tiny"), {"id": "tiny", "root": "/no/such/checkpoint"})
    with pytest.raises(ValueError, match="reports no model directory"):  # another server's /v1/models
        load_tokenizer(ServeBenchConfig(), {"id": "tiny"})


def test_vllm_style_invocations(server, tmp_path):
    """What a vllm bench serve user types: no --model (the served model, its tokenizer from `root` in /v1/models),
    --backend openai-chat on random prompts (sent as text), vLLM's general and sampling flags, --append-result (one
    JSON line per run, latencies kept without --save-detailed), and --backend vllm with a linear ramp-up (vLLM's
    file name and keys)."""
    common = ["--log-level", "WARNING", "bench", "serve", "--base-url", server.url, "--header",
              f"Authorization=Bearer {API_KEY}", "--disable-tqdm", "--no-plots", "--result-dir", str(tmp_path)]
    chat = [*common, "--backend", "openai-chat", "--input_len", "24", "--output-len", "3", "--num-prompts", "3",
            "--temperature", "0.7", "--repetition-penalty", "1.1", "--logprobs", "1", "--append-result",
            "--result-filename", "appended.json"]
    assert main(chat) == 0 and main(chat) == 0
    runs = [json.loads(line) for line in (tmp_path / "appended.json").read_text().splitlines()]
    assert len(runs) == 2
    for res in runs:
        assert (res["backend"], res["completed"], res["total_output_tokens"]) == ("openai-chat", 3, 9)
        assert res["model_id"] == "tiny" and Path(res["tokenizer_id"]).is_dir() and res["rtfx"] == 0.0
        assert len(res["latencies"]) == 3 and "ttfts" not in res
    ramp = [*common, "--backend", "vllm", "--random-input-len", "16", "--random-output-len", "2", "--num-prompts",
            "4", "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "20", "--ramp-up-end-rps", "40",
            "--save-result"]
    assert main(ramp) == 0
    (path,) = tmp_path.glob("vllm-ramp-up-linear-20qps-40qps-tiny-*.json")
    res = json.loads(path.read_text())
    assert (res["ramp_up_strategy"], res["ramp_up_start_rps"], res["ramp_up_end_rps"]) == ("linear", 20, 40)
    assert res["completed"] == 4 and res["backend"] == "vllm"
