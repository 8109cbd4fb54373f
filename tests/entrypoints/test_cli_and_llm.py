"""The command line (`make-tiny`, `generate`) in a real subprocess, and the `LLM` API's input handling."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.sampling_params import child_seed


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_make_tiny_then_generate(tmp_path):
    """`make-tiny` with size flags writes a loadable checkpoint; `generate` prints a completion from it."""
    out = tmp_path / "t"
    res = run_cli("make-tiny", str(out), "--layers", "4", "--hidden", "64", "--experts", "6", "--top-k", "2",
                  "--num-expert-group", "1", "--seed", "3")
    assert res.returncode == 0, res.stderr
    cfg = ModelConfig.from_pretrained(out)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.moe.num_experts, cfg.moe.top_k) == (4, 64, 6, 2)
    assert json.loads((out / "tiny_spec.json").read_text())["seed"] == 3
    res = run_cli("generate", "--model", str(out), "--prompt", "hello world", "--max-tokens", "5", "--ignore-eos",
                  "--no-prefix-caching", "--max-num-seqs", "4")
    assert res.returncode == 0, res.stderr
    assert "5 tokens, finish_reason=length" in res.stderr
    assert "prefix cache" not in res.stderr  # no checkpoint slots were planned


def test_generate_reports_bad_model_dir_cleanly(tmp_path):
    """A directory without config.json is a one-line error and exit code 2, not a traceback."""
    res = run_cli("generate", "--model", str(tmp_path), "--prompt", "x")
    assert res.returncode == 2
    assert "config.json" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, needle", [
    (("serve", "--cache-memory", "2XB"), "cache_memory='2XB'"),
    (("serve", "--checkpoint-memory", "0"), "checkpoint_memory='0'"),
    (("generate", "--prompt", "x", "--cache-memory", "1000GiB"), "GiB are free"),
    (("make-tiny", "/etc/passwd"), "File exists"),
    (("make-tiny", "{tmp}/out", "--routed-scaling-factor", "nan"), "routed_scaling_factor must be a finite"),
    (("make-tiny", "{tmp}/out", "--shard-bytes", "-1"), "shard_bytes must be >= 0"),
    (("bench", "offline", "--num-prompts", "0"), "--num-prompts must be >= 1"),
    (("bench", "http", "--port", "99999"), "--port must be in 1..65535"),
])
def test_bad_settings_are_one_line_errors(args, needle, tmp_path):
    """Start-up settings that cannot work (a cache larger than memory included: allocating it would take the
    machine down) are a one-line error and exit code 2, not a traceback; make-tiny writes nothing then."""
    res = run_cli(*(a.format(tmp=tmp_path) for a in args))
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_make_tiny_help_comes_from_field_docs():
    """CLI help text is generated from the TinySpec attribute docstrings."""
    res = run_cli("make-tiny", "--help")
    assert "every 4th (1-based) and the last are MLA" in " ".join(res.stdout.split())


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir("base")))


def test_text_and_token_prompts(llm):
    """A text prompt and its token ids give the same greedy output; text decodes the ids."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = llm.tokenizer.encode("def add(a, b):")
    a, b = llm.generate(["def add(a, b):", ids], params)
    assert a.prompt_token_ids == ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == llm.tokenizer.decode(a.outputs[0].token_ids, skip_special_tokens=True)
    assert a.outputs[0].finish_reason == "length" and len(a.outputs[0].token_ids) == 8


def test_seeded_sampling_is_reproducible(llm):
    """The same seed gives the same sampled tokens; sampling differs from greedy somewhere."""
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    assert llm.generate([[5, 6, 7]], p)[0].outputs[0].token_ids == first
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids != first


def test_stop_token_ends_generation(llm):
    """A stop token id ends the output (kept as the last token) with finish_reason 'stop'."""
    greedy = llm.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    ids = greedy[0].outputs[0].token_ids
    stop = ids[4]
    out = llm.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop],
                                                    ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "prompt, needle",
    [([], "empty"), ([5, 10**6], "outside the vocabulary"), ([-1], "outside the vocabulary"),
     (list(range(10)) * 500, "max_model_len")],
    ids=["empty", "too-large-id", "negative-id", "too-long"],
)
def test_bad_prompts_raise_value_error(llm, prompt, needle):
    """Bad prompts raise ValueError naming the problem, before touching the model."""
    with pytest.raises(ValueError, match=needle):
        llm.generate([prompt], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("call, needle", [
    (dict(sampling_params=[SamplingParams(max_tokens=50, ignore_eos=True), None]), r"sampling_params\[1\]"),
    (dict(sampling_params=[SamplingParams(), {"max_tokens": 3}]), r"sampling_params\[1\]"),
    (dict(priority=["x", 1]), r"priority\[0\]"),
    (dict(priority=[1]), "priority"),
    (dict(prompts=[[1.9, 2.2], [3]]), "token ids"),
    (dict(prompts=b"hello"), "prompts"),
    (dict(priority=[0, 2**70]), "64-bit"),  # refused by the engine core, after the first prompt was queued
])
def test_bad_generate_arguments_leave_the_engine_clean(llm, call, needle):
    """A bad sampling_params, priority or prompt list is refused before anything is queued (a request left in the
    engine by a half-done call broke every later generate), and the LLM keeps working."""
    args = {"prompts": [[5, 9], [7, 8]], **call}
    with pytest.raises((ValueError, TypeError), match=needle):
        llm.generate(args.pop("prompts"), **args)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[5, 9]], SamplingParams(max_tokens=3))[0].outputs[0].finish_reason == "length"


def _step_raising(llm, error: BaseException, after: int):
    """llm.engine.step, except that the call after `after` good ones raises `error` (once)."""
    real, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == after + 1:
            raise error
        return real()

    return step


@pytest.mark.parametrize("where, error_type", [("step", KeyboardInterrupt), ("step", RuntimeError),
                                               ("detokenizer", KeyboardInterrupt)],
                         ids=["interrupt-in-step", "exception-in-step", "interrupt-in-detokenizer"])
def test_interrupted_or_failed_call_aborts_its_requests_and_the_llm_goes_on(llm, monkeypatch, where, error_type):
    """A KeyboardInterrupt or an exception part-way (inside an engine step, or while detokenizing) leaves generate
    with that exception, nothing of the call stays in the engine, and the next call gives the outputs of an
    undisturbed one. (The exception is made here, not in the parametrization: a parametrized instance lives for the
    whole session, and its traceback, once raised, would keep this module's engine alive.)"""
    error = error_type("injected")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 9, 11], [7, 8], [3, 4, 5, 6]]
    expected = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    if where == "step":
        monkeypatch.setattr(llm.engine, "step", _step_raising(llm, error, after=3))
    else:
        real, calls = llm.tokenizer.decode_bytes, []

        def decode_bytes(*args, **kwargs):
            calls.append(1)
            if len(calls) == 5:
                raise error
            return real(*args, **kwargs)

        monkeypatch.setattr(llm.tokenizer, "decode_bytes", decode_bytes)
    with pytest.raises(type(error)):
        llm.generate(prompts, params)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == expected


def test_generate_inside_a_running_event_loop(llm):
    """generate works where the calling thread already runs an event loop (a notebook), with the same outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids

    async def in_a_loop():
        return llm.generate([[5, 6, 7]], params)

    assert asyncio.run(in_a_loop())[0].outputs[0].token_ids == expected


def test_n_fan_out_and_stop_strings(llm):
    """n=2 gives each output its child seed's tokens; a stop string ends an output with 'stop' and cuts its text
    before the stop string, and the request ends there in the engine."""
    params = SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=12, ignore_eos=True)
    both = llm.generate([[5, 6, 7]], params)[0].outputs
    for j, out in enumerate(both):
        alone = llm.generate([[5, 6, 7]], dataclasses.replace(params, n=1, seed=child_seed(21, j)))[0].outputs[0]
        assert (out.index, out.token_ids, out.text) == (j, alone.token_ids, alone.text)
    text = both[0].text
    stop = text[len(text) // 2:][:2]
    stopped = llm.generate([[5, 6, 7]], dataclasses.replace(params, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]
    assert len(stopped.token_ids) < len(both[0].token_ids) and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"top_k": -2}, "top_k"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": None}, "stop"),
     ({"stop_token_ids": 5}, "stop_token_ids"), ({"temperature": 10**400}, "temperature"),
     ({"ignore_eos": "no"}, "ignore_eos"), ({"structured": "json"}, "structured"), ({"seed": 2**64}, "seed")],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    """Invalid SamplingParams raise ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_dtype_and_missing_model():
    """LLM rejects an unknown dtype and a missing model directory with errors naming them."""
    with pytest.raises((ValueError, FileNotFoundError), match="nonexistent"):
        LLM(model="/nonexistent")
    with pytest.raises(ValueError, match="dtype"):
        LLM(model="/nonexistent", dtype="float16")


def test_bench_offline_runs_and_writes_json(tiny_dir, tmp_path):
    """`deltaserve bench offline` on a small workload (no baseline) reports throughput and writes its JSON."""
    result = tmp_path / "r.json"
    res = run_cli("bench", "offline", "--model", str(tiny_dir("base")), "--num-prompts", "3", "--input-len", "9",
                  "--output-len", "4", "--no-baseline", "--result-file", str(result))
    assert res.returncode == 0, res.stderr
    data = json.loads(result.read_text())
    assert data["deltaserve"]["output_tokens"] == 12 and data["deltaserve"]["output_throughput"] > 0
    assert data["config"]["num_prompts"] == 3
    roof = data["deltaserve"]["roofline"]
    # 4 tokens each: the first comes out of the prefill step, the other 3 out of pure decode steps of all 3 prompts.
    assert roof["decode_steps"] == 3 and roof["mean_batch"] == 3
    assert 0 < roof["share"] < 1 and roof["bandwidth_bytes_per_s"] > 0 and roof["mean_bytes_per_step"] > 0
    assert data["deltaserve"]["cuda_graphs"] == {"captured": False, "sizes": [], "replays": 0}  # a CPU: eager
