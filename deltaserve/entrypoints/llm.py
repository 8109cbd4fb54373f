"""`LLM`: the offline Python API (vLLM-style): `LLM(model=PATH).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Prompt = str | Sequence[int]


class LLM:
    """Generate from a Kimi Linear checkpoint directory.

    Args:
        model: checkpoint directory (config.json, safetensors weights, tokenizer files).
        dtype: "float32" or "bfloat16" for activations and weights (router, gates and KDA state stay fp32).
        max_model_len: cap on prompt + output tokens (defaults to the model's own limit).
    """

    def __init__(self, model: str | None = None, dtype: str = "float32", max_model_len: int | None = None) -> None:
        if model is None:
            raise ValueError("model is required: pass a checkpoint directory (make one with `deltaserve make-tiny`)")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported (supported: {sorted(_DTYPES)})")
        self.engine = LLMEngine(model, dtype=_DTYPES[dtype], max_model_len=max_model_len)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of token ids); returns one RequestOutput per prompt."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        results = []
        for prompt in prompts:
            if isinstance(prompt, str):
                text, ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, ids = None, [int(t) for t in prompt]
            results.append(self.engine.generate_one(str(self._next_id), text, ids, params))
            self._next_id += 1
        return results
