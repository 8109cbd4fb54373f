"""Long prompts on a tiny checkpoint whose length limit is raised to 1M tokens: the greedy tokens do not depend on
how the prompt is chunked (`max_num_batched_tokens`), and while it is prefilled the request holds one KDA state slot
whatever its length; only its MLA KV blocks grow with the context.

The slow variants run 64K- and 256K-token prompts (chunks of 16K and 64K tokens) on the long-context tiny checkpoint
(`tiny_spec.LONG_CONTEXT`: one MLA layer of one head, since MLA attention is quadratic in the context; see
docs/benchmarks.md): minutes on a 2-core CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deltaserve.config import CacheConfig, EngineConfig, SchedulerConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.models.tiny import write_tiny_checkpoint
from deltaserve.models.tiny_spec import LONG_CONTEXT
from deltaserve.sampling_params import SamplingParams

MAX_LEN = 1 << 20
BLOCK = 16


def _raise_limit(model: Path) -> Path:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_max_length": MAX_LEN}))
    return model


@pytest.fixture(scope="module")
def long_model(tiny_dir, tmp_path_factory) -> Path:
    """The base tiny checkpoint with `model_max_length` raised to 1M tokens."""
    model = tmp_path_factory.mktemp("tiny-1m") / "model"
    shutil.copytree(tiny_dir("base"), model)
    return _raise_limit(model)


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    """The long-context tiny checkpoint with `model_max_length` raised to 1M tokens."""
    return _raise_limit(write_tiny_checkpoint(tmp_path_factory.mktemp("long-context") / "model", LONG_CONTEXT))


def _prompt(length: int) -> list[int]:
    gen = torch.Generator().manual_seed(length)
    return torch.randint(0, 1000, (length,), generator=gen).tolist()


def _greedy(model: Path, prompt: list[int], chunk: int, max_tokens: int = 4) -> tuple[list[int], list[tuple]]:
    """Greedy tokens of `prompt` prefilled in chunks of `chunk` tokens, and per prefill step (computed tokens, KV
    blocks held, state slots in use)."""
    cfg = EngineConfig(model=str(model), max_model_len=MAX_LEN, num_threads=1,
                       cache=CacheConfig(num_blocks=len(prompt) // BLOCK + 8, num_state_slots=2, block_size=BLOCK),
                       scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=2))
    core = EngineCore(cfg)
    try:
        core.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        tokens: list[int] = []
        held: list[tuple] = []
        while core.scheduler.has_unfinished():
            for out in core.step():
                tokens += out.new_token_ids
            request = core.scheduler.requests.get("r")
            if request is not None and not tokens:
                usage = core.scheduler.cache.usage()
                held.append((request.num_computed_tokens, len(core.scheduler.cache.block_ids("r")),
                             usage.num_slots - usage.num_free_slots))
        return tokens, held
    finally:
        core.shutdown()


def _check(model: Path, length: int, chunks: tuple[int, int]) -> None:
    prompt = _prompt(length)
    small, held = _greedy(model, prompt, chunks[0])
    large, _ = _greedy(model, prompt, chunks[1])
    assert len(small) == 4 and small == large
    assert len(held) == -(-length // chunks[0]) - 1  # every step but the last, which samples
    for computed, blocks, slots in held:
        assert slots == 1  # one KDA state slot, whatever the context
        assert blocks == -(-computed // BLOCK)  # KV for the computed tokens, no more


def test_long_prompt_chunking_keeps_greedy_tokens(long_model: Path) -> None:
    """A 3,000-token prompt (several MLA context blocks and query tiles) in chunks of 448 and in one chunk."""
    _check(long_model, 3000, (448, 4096))


@pytest.mark.slow
@pytest.mark.parametrize("length", [65536, 262144])
def test_long_prompt_chunking_keeps_greedy_tokens_slow(long_context_model: Path, length: int) -> None:
    _check(long_context_model, length, (16384, 65536))
