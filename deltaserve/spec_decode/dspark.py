"""`BlockDraftProposer`: the engine side of speculative method `dspark` (alias `dflash`).

The drafter runs on the workers, right after each step's sampling, conditioned on the target's hidden states there
(`runner/block_drafting.py`); its drafts come back with the step's output (`RunnerOutput.drafts`) and are handed to
this proposer (`receive`), which offers them for the request's next step. A draft applies only while the request
still has exactly the tokens it continues (so a request preempted, or one whose step was not scheduled, never gets
a stale block), and is cut to what the request may still generate.

The distributions that sampled drafts were drawn from stay on the workers (the verification there reads them), so
proposals carry no probabilities; they carry the drafter's per-position confidences, which adaptive verification
weighs (`adaptive.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.models.dspark import DSparkConfig, drafter_weight_bytes, request_bytes, resolve_drafter_path
from deltaserve.request import Request
from deltaserve.scheduler.output import BlockDraft
from deltaserve.spec_decode.proposer import Proposal


class BlockDraftProposer:
    """Offers the block drafter's last drafts of each request. `memory_bytes`: the drafter's weights and, per
    sequence the engine may run, its feature window and kept draft distributions (allocated on the workers)."""

    def __init__(self, *, model: str | None, num_speculative_tokens: int, engine: EngineConfig) -> None:
        path = resolve_drafter_path(model, engine.model)
        cfg = DSparkConfig.from_pretrained(path)
        target = ModelConfig.from_pretrained(engine.model)
        if (cfg.vocab_size, cfg.hidden_size) != (target.vocab_size, target.hidden_size):
            raise ValueError(f"speculative_config.model {str(path)!r} drafts for vocab {cfg.vocab_size} / hidden "
                             f"{cfg.hidden_size}, the target {engine.model!r} has {target.vocab_size} / "
                             f"{target.hidden_size}")
        if max(cfg.tap_layers) >= target.num_hidden_layers:
            raise ValueError(f"speculative_config.model {str(path)!r} taps layers {list(cfg.tap_layers)}, the "
                             f"target has {target.num_hidden_layers}")
        if num_speculative_tokens > cfg.block_size:
            raise ValueError(f"speculative_config.num_speculative_tokens {num_speculative_tokens} exceeds the "
                             f"drafter's block_size {cfg.block_size}")
        self.k, self.config = num_speculative_tokens, cfg
        elem = torch.tensor([], dtype=getattr(torch, engine.dtype)).element_size()
        self.weight_bytes = drafter_weight_bytes(cfg, elem)
        self.bytes_per_seq = request_bytes(cfg, elem)
        self.max_num_seqs = engine.scheduler.max_num_seqs
        self._drafts: dict[str, BlockDraft] = {}

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.max_num_seqs * self.bytes_per_seq

    def receive(self, drafts: Mapping[str, BlockDraft]) -> None:
        """The drafts a step made (they replace the requests' earlier ones)."""
        self._drafts.update(drafts)

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        out = {}
        for request in requests:
            draft = self._drafts.get(request.request_id)
            if draft is None or draft.num_tokens != request.num_tokens:
                continue
            room = min(request.params.max_tokens - len(request.output_token_ids),
                       request.max_total_tokens - request.num_tokens)  # tokens it may still gain
            n = min(self.k, room - 1)  # the step samples one token besides the drafts
            if n >= 1:
                out[request.request_id] = Proposal(list(draft.token_ids[:n]), confidences=draft.confidences[:n])
        return out

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
