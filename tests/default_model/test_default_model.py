"""The embedded default model: shipped as package data, loaded by `LLM()` / `deltaserve serve` with no model, and
greedy-identical to transformers' `KimiLinearForCausalLM` on the same checkpoint (the parity test)."""

from __future__ import annotations

import json

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.chat import ChatMessage, ToolSpec, get_chat_format
from deltaserve.config import ModelConfig
from deltaserve.default_model import default_model_dir
from deltaserve.entrypoints.cli import build_parser
from tests.helpers import hf_greedy

MAX_BYTES = 30 * 1024 * 1024
WEATHER = ToolSpec(name="get_weather", description="Current weather in a city.",
                   parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


def _prompts(llm: LLM) -> list[list[int]]:
    fmt = get_chat_format(default_model_dir(), llm.tokenizer)
    user = ChatMessage(role="user", content="What's the weather in Paris?")
    return [
        fmt.render([user], tools=[WEATHER], thinking=False),
        fmt.render([ChatMessage(role="user", content="What is the capital of France?")], thinking=False),
        fmt.render([ChatMessage(role="user", content="Calculate 12 * 7.")], tools=[WEATHER], thinking=True),
    ]


def test_checkpoint_is_package_data_in_the_kimi_linear_format():
    """The shipped files exist, weigh at most 30 MB, and describe a Kimi Linear model with KDA:MLA 3:1 and MoE."""
    root = default_model_dir()
    names = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json", "MODEL_CARD.md"}
    assert names <= {p.name for p in root.iterdir()}
    assert sum(p.stat().st_size for p in root.iterdir() if p.is_file()) <= MAX_BYTES
    config = ModelConfig.from_pretrained(root)
    raw = json.loads((root / "config.json").read_text())
    kinds = raw["linear_attn_config"]
    assert len(kinds["kda_layers"]) == 3 * len(kinds["full_attn_layers"])
    assert raw["first_k_dense_replace"] == 1 and raw["num_shared_experts"] >= 1 and raw["num_experts"] > 1
    assert config.vocab_size == raw["vocab_size"]


def test_llm_without_a_model_loads_the_embedded_model(llm):
    """`LLM()` serves the embedded checkpoint and answers a chat prompt with a stop token."""
    assert llm.engine.model_config is not None
    out = llm.generate([_prompts(llm)[1]], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert out.token_ids and out.finish_reason == "stop"


def test_serve_and_generate_need_no_model_argument():
    """`deltaserve serve` and `deltaserve generate` parse without --model (the embedded model is the default)."""
    parser = build_parser()
    assert parser.parse_args(["serve"]).model is None
    assert parser.parse_args(["generate", "--prompt", "hi"]).model is None


def test_greedy_output_matches_transformers(llm):
    """Greedy tokens from deltaserve equal transformers' KimiLinearForCausalLM up to and including the stop token."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.KimiLinearForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32,
                                                            experts_implementation="eager").eval()
    prompts = _prompts(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    for ids, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        ref = hf_greedy(hf, ids, len(ours))
        assert ours == ref, f"prompt of {len(ids)} tokens: deltaserve {ours} != transformers {ref}"
