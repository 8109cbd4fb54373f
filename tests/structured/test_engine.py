"""Structured output through the engine on a tiny random model: the text obeys the constraint, unconstrained
requests in the same batch are unchanged, preemption keeps outputs identical, compile errors finish only their
request, and compiling never stalls the step loop."""

from __future__ import annotations

import json
import re
import threading

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.request import FinishReason
from deltaserve.sampling_params import StructuredOutput
from deltaserve.structured import Grammar
from tests.helpers import prompt_ids

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 160  # the schema bounds the text: at most ~8 * 6 escaped bytes of name plus ~70 bytes of the rest


def slow_schema(num_properties: int = 3000) -> StructuredOutput:
    """A schema that takes llguidance ~0.3 s to compile (a little under its size limit)."""
    props = {f"p{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(10)]} for i in range(num_properties)}
    return StructuredOutput("json_schema", json.dumps({"type": "object", "properties": props,
                                                       "required": list(props)}))


@pytest.fixture(scope="module")
def path(tiny_dir):
    return str(tiny_dir("base"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path)


def prompts(n: int, seed: int, lengths=(5, 11, 23, 37, 52, 64, 71, 90)) -> list[list[int]]:
    return [prompt_ids(1024, lengths[i % len(lengths)], seed=seed + i) for i in range(n)]


def outputs(results) -> list:
    return [r.outputs[0] for r in results]


def assert_no_leaks(engine: EngineCore) -> None:
    assert not engine.has_unfinished_requests()
    usage = engine.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots


def test_json_schema_batched_with_unconstrained_requests(llm):
    """Greedy and sampled constrained requests give schema-valid JSON and stop by themselves; the unconstrained
    requests of the same batch produce exactly what they produce without the constrained ones."""
    free_prompts, json_prompts = prompts(3, seed=10), prompts(4, seed=20)
    free_params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=6, top_k=40, max_tokens=12, repetition_penalty=1.2)]
    json_params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=JSON),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS, structured=JSON),
                   SamplingParams(temperature=0.7, seed=2, top_p=0.9, max_tokens=MAX_TOKENS, structured=JSON),
                   SamplingParams(temperature=1.2, seed=3, presence_penalty=0.5, max_tokens=MAX_TOKENS,
                                  structured=JSON, logprobs=2)]
    baseline = outputs(llm.generate(free_prompts, free_params))
    mixed = outputs(llm.generate(free_prompts + json_prompts, free_params + json_params))
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in baseline]
    for out in mixed[3:]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert mixed[-1].logprobs is not None and len(mixed[-1].logprobs) == len(mixed[-1].token_ids)
    assert_no_leaks(llm.engine)


def test_regex_constraint(llm):
    pattern = r"[a-z]{3,6}-[0-9]{2}( ok)?"
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, structured=StructuredOutput("regex", pattern))
              for i, t in enumerate([0.0, 1.0, 1.5])]
    for out in outputs(llm.generate(prompts(3, seed=30), params)):
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, out.text), out.text


def test_json_object(llm):
    """Every output is a JSON object, or (cut by max_tokens) a prefix the grammar still accepts."""
    structured = StructuredOutput("json_object")
    params = [SamplingParams(temperature=t, seed=i, max_tokens=64, structured=structured)
              for i, t in enumerate([0.0, 0.5, 1.0, 1.0, 1.5, 1.0, 0.7, 0.0])]
    outs = outputs(llm.generate([prompt_ids(1024, 5 + 3 * i, seed=i) for i in range(8)], params))
    backend = llm.engine.structured.backend()
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")
            grammar = backend.compile(structured, frozenset(llm.eos_token_ids))
            assert all(grammar.accept_token(t) for t in out.token_ids)
    assert any(out.finish_reason == "stop" for out in outs)


def test_lark_grammar_with_a_special_token(llm):
    lark = 'start: ("yes" | "no") <|im_middle|> ("done" | "later")'
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=20, skip_special_tokens=False,
                            structured=StructuredOutput("lark", lark))
    out = outputs(llm.generate(prompts(1, seed=40), params))[0]
    assert out.finish_reason == "stop"
    assert re.fullmatch(r"(yes|no)<\|im_middle\|>(done|later)(\[EOS\]|<\|im_end\|>)", out.text), out.text


def test_invalid_grammar_finishes_only_that_request(llm):
    """A constraint that fails to compile in the engine ends its request with finish_reason "error" and no
    tokens; the other requests of the call and later calls are served."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "(unclosed")),
              SamplingParams(max_tokens=8, structured=StructuredOutput("json_schema", '{"type": "nope"}'))]
    good, bad_regex, bad_schema = outputs(llm.generate(prompts(3, seed=50), params))
    assert good.finish_reason == "stop" or len(good.token_ids) == 8
    for bad in (bad_regex, bad_schema):
        assert bad.finish_reason == FinishReason.ERROR.value and bad.token_ids == [] and bad.text == ""
    again = outputs(llm.generate(prompts(1, seed=60), SamplingParams(max_tokens=MAX_TOKENS, structured=JSON)))[0]
    jsonschema.validate(json.loads(again.text), SCHEMA)
    assert_no_leaks(llm.engine)


def test_engine_reports_the_compile_error(llm):
    engine = llm.engine
    engine.add_request("bad", prompts(1, seed=70)[0], SamplingParams(structured=StructuredOutput("lark", "start: x")))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("bad", FinishReason.ERROR)]
    assert "unknown name" in outs[0].error


def test_preemption_keeps_constrained_outputs(llm, path):
    """A cache too small for the batch preempts (recompute) constrained requests; the grammar is never re-fed, so
    outputs equal the unpreempted run and stay schema-valid."""
    ps = prompts(6, seed=80, lengths=(40, 64, 90, 23, 71, 52))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=MAX_TOKENS, structured=JSON)
              for i in range(6)]
    reference = [o.token_ids for o in outputs(llm.generate(ps, params))]
    small = LLM(model=path, num_blocks=18, num_state_slots=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    got = outputs(small.generate(ps, params))
    assert small.engine.scheduler.num_preemptions >= 1
    assert [o.token_ids for o in got] == reference
    for out in got:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert_no_leaks(small.engine)


def test_compile_does_not_stall_other_requests(llm, monkeypatch):
    """While a grammar compiles, a decoding request keeps getting a token every step and the constrained request
    is not scheduled; it joins once compiled. The real compile is held back until the test has seen five steps (a
    timing-free version of "slow compile": on a loaded machine a 0.2 s compile spanned only two slow steps)."""
    engine = llm.engine
    release = threading.Event()
    real_compile = engine.structured._compile

    def held_compile(structured, stop_token_ids):
        release.wait(timeout=60)
        return real_compile(structured, stop_token_ids)

    monkeypatch.setattr(engine.structured, "_compile", held_compile)
    engine.add_request("free", prompts(1, seed=90)[0], SamplingParams(temperature=0.0, max_tokens=400,
                                                                      ignore_eos=True))
    try:
        while not engine.step():
            pass
        engine.add_request("slow", prompts(1, seed=91)[0], SamplingParams(max_tokens=4, structured=slow_schema()))
        for _ in range(5):
            outs = engine.step()
            assert "slow" not in engine.scheduler.requests and engine.structured.is_pending("slow")
            assert [len(o.new_token_ids) for o in outs if o.request_id == "free"] == [1]
        release.set()
        while engine.structured.is_pending("slow"):
            outs = engine.step()
            assert [len(o.new_token_ids) for o in outs if o.request_id == "free"] == [1]
        assert "slow" in engine.scheduler.requests
    finally:
        release.set()
        engine.abort_request("slow")
        engine.abort_request("free")
    assert_no_leaks(engine)


def test_abort_frees_compiling_and_running_grammars(llm):
    engine = llm.engine
    engine.add_request("compiling", prompts(1, seed=100)[0], SamplingParams(structured=slow_schema()))
    engine.abort_request("compiling")
    assert not engine.has_unfinished_requests() and engine.step() == []
    engine.add_request("running", prompts(1, seed=101)[0], SamplingParams(max_tokens=MAX_TOKENS, structured=JSON))
    while "running" not in engine.scheduler.requests or not engine.scheduler.requests["running"].output_token_ids:
        engine.step()
    assert "running" in engine.grammar_hook.grammars
    engine.abort_request("running")
    assert "running" not in engine.grammar_hook.grammars
    assert_no_leaks(engine)


class _AllowEverything(Grammar):
    """Wraps a real grammar but writes no mask, so the sampler can pick a token the grammar then rejects."""

    def __init__(self, inner: Grammar) -> None:
        self.inner = inner

    def accept_token(self, token_id: int) -> bool:
        return self.inner.accept_token(token_id)

    def fill_bitmask(self, bitmask, row: int) -> None:
        pass  # the row stays all-ones

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def validate_tokens(self, token_ids) -> int:
        return self.inner.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)


def test_rejected_token_finishes_the_request_with_an_error(path):
    """Should a grammar reject the sampled token, the request ends with FinishReason.ERROR and the engine goes on."""
    small = LLM(model=path, max_num_batched_tokens=8)
    engine = small.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                            structured=StructuredOutput("lark", "start: <|im_middle|>+"))
    engine.add_request("r", prompts(1, seed=110, lengths=(40,))[0], params)
    while "r" not in engine.scheduler.requests:
        assert engine.step() == []  # compiling, then the first 8-token prefill chunk
    request = engine.scheduler.requests["r"]
    assert not request.output_token_ids
    engine.grammar_hook.grammars["r"] = _AllowEverything(engine.grammar_hook.grammars["r"])
    events = []
    while engine.has_unfinished_requests():
        events += engine.step()
    assert len(events) == 1 and events[0].finish_reason is FinishReason.ERROR
    assert "rejected token" in events[0].error and "r" not in engine.grammar_hook.grammars
    assert_no_leaks(engine)
    out = outputs(small.generate(prompts(1, seed=111), SamplingParams(max_tokens=MAX_TOKENS, structured=JSON)))[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_unavailable_backend_is_refused_at_start(path):
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="xgrammar"):
            EngineCore(EngineConfig(model=path, structured_output_backend="xgrammar"))
    with pytest.raises(ValueError, match="structured_output_backend"):
        EngineConfig(model=path, structured_output_backend="outlines")
