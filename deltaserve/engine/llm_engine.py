"""A one-request-at-a-time engine: prefill the prompt, then decode token by token through the `ModelRunner`.

This is the first brick; the continuous-batching `EngineCore` replaces it behind the same `LLM` API.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from deltaserve.config import ModelConfig
from deltaserve.models.loader import load_model
from deltaserve.outputs import CompletionOutput, RequestOutput
from deltaserve.runner.model_runner import ModelRunner, ScheduledChunk
from deltaserve.runner.sampler import sample
from deltaserve.sampling_params import SamplingParams
from deltaserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    """Loads a checkpoint and generates for one prompt at a time."""

    def __init__(self, model: str | Path, *, dtype: torch.dtype, block_size: int = 16,
                 max_model_len: int | None = None) -> None:
        path = Path(model)
        self.config = ModelConfig.from_pretrained(path)
        logger.info("loading %s (%s) in %s", path, self.config.architecture, dtype)
        self.model = load_model(path, dtype=dtype)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.max_model_len = min(self.config.max_model_len, max_model_len or self.config.max_model_len)
        self.block_size = block_size
        self.eos_token_ids = frozenset(self.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.runner: ModelRunner | None = None

    def _runner_for(self, num_tokens: int) -> ModelRunner:
        blocks = math.ceil(num_tokens / self.block_size)
        if self.runner is None or self.runner.num_blocks < blocks:
            self.runner = ModelRunner(self.model, num_blocks=blocks, block_size=self.block_size, num_slots=1)
        return self.runner

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise ValueError for an empty, out-of-vocabulary or too long prompt."""
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                "(room for one generated token is needed)"
            )

    def generate_one(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                     params: SamplingParams) -> RequestOutput:
        """Run one request to completion."""
        self.check_prompt(prompt_ids)
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        runner = self._runner_for(len(prompt_ids) + max_new)
        block_ids = list(range(runner.num_blocks))
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        out: list[int] = []
        chunk = ScheduledChunk(new_token_ids=prompt_ids, num_computed_tokens=0, state_slot=0, block_ids=block_ids,
                               reset_state=True)
        finish = "length"
        while len(out) < max_new:
            logits = runner.execute([chunk])
            if len(out) < params.min_tokens and stops:
                logits[:, sorted(stops)] = float("-inf")  # no stop before min_tokens
            token = int(sample(logits, [params], [gen])[0])
            out.append(token)
            if token in stops:
                finish = "stop"
                break
            chunk = ScheduledChunk(new_token_ids=[token], num_computed_tokens=len(prompt_ids) + len(out) - 1,
                                   state_slot=0, block_ids=block_ids)
        text = self.tokenizer.decode(out, skip_special_tokens=params.skip_special_tokens)
        completion = CompletionOutput(index=0, text=text, token_ids=out, finish_reason=finish)
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids,
                             outputs=[completion], finished=True)
