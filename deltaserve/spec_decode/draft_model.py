"""`DraftModelProposer`: a small model of the same tokenizer drafts the next tokens (vLLM's `draft_model` method).

The draft runs in the engine core process, on the engine's device, through its own `ModelRunner` (own MLA KV blocks
and KDA state slots) with block and slot ids from its own `CacheManager` (prefix caching off). Its memory is sized
so that every sequence the target may run at once (`max_num_seqs`, each up to the target's `max_model_len`) has a
place: the draft is admitted together with the target.

Per request the proposer keeps P, the number of tokens folded into the request's committed state slot. A
`propose` call is, for all requests together:

1. one batched catch-up forward of tokens [P, N) of every request on its committed slot (N = the request's
   `num_tokens`: every token the target accepted or sampled so far), whose last logits give draft token 1; P = N;
2. k - 1 batched decode forwards, draft j + 1 from draft j, each on a work slot of its own: work slot j of a request
   starts as a copy of the state before draft j (the committed one, or work slot j - 1) and ends as the state after
   it. Their KV rows lie at positions >= N in the request's blocks.

So the committed state is only ever "the state after accepted tokens" and no rejected token is rolled back: the
next catch-up overwrites the KV rows of rejected drafts. Accepted drafts are not computed twice: when the request's
new tokens start with a drafts (a <= k - 1), the state after them is already in work slot a (and their KV rows in the
blocks), so it is copied into the committed slot and the catch-up is only the rest, usually the one token the
target sampled: a decode instead of a (k + 1)-token chunk. A target request that is preempted and recomputed has the
same tokens, so the draft's state stays valid.

Sampling: greedy requests, or every request with `draft_sample_method="greedy"`, get the draft's argmax (no probs).
Otherwise draft token j is drawn from q = softmax(filter(logits / temperature)) with the request's temperature and
its top_k / top_p / min_p filters (penalties, logit bias and allowed / banned tokens are left to the target: any q is
valid for rejection sampling as long as the token is drawn from the q returned), with a generator of the request's
own, seeded from its seed (mixed, so that its draws never mirror the target's generator of the same seed), or from
the engine's seed for unseeded requests; `Proposal.probs` is that ``[n, vocab]`` q.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.layers.forward_batch import KDALayerCache
from deltaserve.models.loader import load_model
from deltaserve.ops import sampling as sampling_ops
from deltaserve.request import Request
from deltaserve.runner.draft_distribution import draft_distribution, draft_seed
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.scheduler.output import ScheduledChunk
from deltaserve.spec_decode.proposer import Proposal

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
@dataclass(slots=True)
class _DraftState:
    """What the proposer keeps for one request."""

    request: Request
    """The request object: a finished one (or a new request reusing its id) frees the state."""
    num_folded: int = 0
    """P: the tokens already folded into the committed state slot (and whose KV rows are cached)."""
    last_logits: torch.Tensor | None = None
    """fp32 [vocab] draft logits after the P folded tokens (for a call that finds no new token)."""
    generator: torch.Generator | None = None
    """The sampled drafts' generator (seeded requests only; unseeded ones share the proposer's)."""
    folded_drafts: list[int] = field(default_factory=list)
    """The last call's drafts 1..m (m <= k - 1) whose states are in work slots 1..m, drafted after P tokens."""


@dataclass(frozen=True, slots=True)
class _Row:
    """One request served by this `propose` call."""

    state: _DraftState
    num_tokens: int
    """N: the request's known tokens (the catch-up target)."""
    num_drafts: int
    """n <= k: drafts to propose."""
    sampled: bool


class DraftModelProposer:
    """Proposes up to `num_speculative_tokens` tokens per request from a draft checkpoint with the target's vocabulary.

    `memory_bytes`: the draft's weights plus its KV blocks and state slots (committed and work slots)."""

    def __init__(self, *, model: str, num_speculative_tokens: int, draft_sample_method: str | None = "probabilistic",
                 engine: EngineConfig) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        draft_sample_method = draft_sample_method or "probabilistic"
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method must be 'greedy' or 'probabilistic', got {draft_sample_method!r}")
        self.k, self.sample_method = num_speculative_tokens, draft_sample_method
        target = ModelConfig.from_pretrained(engine.model)
        draft = ModelConfig.from_pretrained(model)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {model!r} has vocab_size {draft.vocab_size}, the target "
                             f"model {engine.model!r} has {target.vocab_size}: a draft needs the target's tokenizer")
        # The target's dtype, not the draft config's: a draft equal to the target then proposes exactly the target's
        # argmax, and a bf16 draft on CPU would be slower than fp32 (as vLLM, the draft runs in the target's dtype).
        self.model = load_model(model, dtype=getattr(torch, engine.dtype), device=engine.device)
        max_len = min(engine.max_model_len or target.max_model_len, target.max_model_len)
        self.max_num_seqs = engine.scheduler.max_num_seqs
        block_size = engine.cache.block_size
        # Each sequence holds blocks for its tokens plus the k - 1 draft rows written past them.
        self.blocks_per_seq = math.ceil((max_len + num_speculative_tokens) / block_size)
        self.max_len = self.blocks_per_seq * block_size
        self.cache = CacheManager(num_blocks=self.max_num_seqs * self.blocks_per_seq, num_slots=self.max_num_seqs,
                                  block_size=block_size)
        # Slots [0, max_num_seqs) are the committed ones (the cache manager's); committed slot c owns the k - 1 work
        # slots after them from max_num_seqs + c * (k - 1) (see `_work_slot`).
        self.runner = ModelRunner(self.model, num_blocks=self.max_num_seqs * self.blocks_per_seq,
                                  block_size=block_size, num_slots=self.max_num_seqs * num_speculative_tokens,
                                  max_num_tokens=engine.scheduler.max_num_batched_tokens)
        self.max_num_batched_tokens = engine.scheduler.max_num_batched_tokens
        self.generator = torch.Generator(device=self.runner.device).manual_seed(draft_seed(engine.seed))
        self._states: dict[str, _DraftState] = {}

    # -- the Proposer protocol ----------------------------------------------------------------------------------

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    @property
    def memory_bytes(self) -> int:
        weights = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        tensors = [t for c in self.runner.caches for t in ((c.state, c.conv) if isinstance(c, KDALayerCache)
                                                            else (c.kv,))]
        caches = sum(t.numel() * t.element_size() for t in tensors)
        return weights + caches

    def forget(self, request_id: str) -> None:
        """Free the request's draft blocks and state slot (unknown ids are ignored)."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.free(state.request, save_state=False)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        """Up to k drafts per request: one catch-up forward, then k - 1 decode forwards, each batched over all."""
        self._drop_finished()
        rows = self._admit(requests)
        if not rows:
            return {}
        self._reuse_accepted(rows)
        first = self._catch_up(rows)  # [B, V] logits of draft token 1
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        self._pick(rows, list(range(len(rows))), first, drafts, probs)
        for j in range(1, max(r.num_drafts for r in rows)):
            # Draft j + 1 from draft j, on work slot j: a copy of the state before draft j (the committed slot or
            # work slot j - 1), kept after the call so that accepted drafts need no recomputing.
            active = [i for i, r in enumerate(rows) if r.num_drafts > j]
            slots = {i: self.cache.slot(rows[i].state.request.request_id) for i in active}
            self.runner.apply_copies([], [(slots[i] if j == 1 else self._work_slot(slots[i], j - 1),
                                           self._work_slot(slots[i], j)) for i in active])
            chunks = [ScheduledChunk(
                request_id=rows[i].state.request.request_id, new_token_ids=[drafts[i][-1]],
                num_computed_tokens=rows[i].num_tokens + j - 1, state_slot=self._work_slot(slots[i], j),
                block_ids=self.cache.block_ids(rows[i].state.request.request_id)) for i in active]
            self._pick(rows, active, self.runner.execute_model(chunks), drafts, probs)
        for i, r in enumerate(rows):
            r.state.folded_drafts = drafts[i][: r.num_drafts - 1]
        return {r.state.request.request_id: Proposal(drafts[i], torch.stack(probs[i]) if r.sampled else None)
                for i, r in enumerate(rows)}

    # -- steps ---------------------------------------------------------------------------------------------------

    def _drop_finished(self) -> None:
        """Free the states of finished requests (so a core that never calls `forget` leaks nothing either)."""
        for rid in [rid for rid, s in self._states.items() if s.request.is_finished]:
            self.forget(rid)

    def _admit(self, requests: Sequence[Request]) -> list[_Row]:
        """The requests this call serves, each holding blocks for its tokens and draft rows. A request the draft
        cannot serve (no budget left, too long, no memory even after evicting requests not asked for now) is left
        out: it gets no proposal."""
        asked = {r.request_id for r in requests}
        rows = []
        for request in requests:
            room = min(request.params.max_tokens - len(request.output_token_ids),
                       request.max_total_tokens - request.num_tokens)  # tokens the request may still gain
            n_tokens = request.num_tokens
            # The step samples one token besides the drafts; draft rows go up to position N + n - 2.
            n = min(self.k, room - 1, self.max_len - n_tokens + 1)
            if n < 1:
                continue
            state = self._states.get(request.request_id)
            if state is not None and state.request is not request:  # the id was reused by a new request
                self.forget(request.request_id)
                state = None
            if state is None:
                state = _DraftState(request)
                if request.params.seed is not None:
                    state.generator = torch.Generator(device=self.runner.device).manual_seed(
                        draft_seed(request.params.seed))
            if not self._allocate(request, n_tokens + n - 1, asked):
                if request.request_id not in self._states:
                    self.cache.free(request, save_state=False)
                continue
            self._states[request.request_id] = state
            sampled = self.sample_method == "probabilistic" and not request.params.greedy
            rows.append(_Row(state, n_tokens, n, sampled))
        return rows

    def _allocate(self, request: Request, num_tokens: int, asked: set[str]) -> bool:
        if self.cache.allocate(request.request_id, num_tokens):
            return True
        # Only when the target holds more sequences than max_num_seqs said (or ids the core never forgot): the
        # draft's states are a cache, so evicting one only means recomputing it later.
        for rid in [rid for rid in self._states if rid not in asked]:
            self.forget(rid)
            if self.cache.allocate(request.request_id, num_tokens):
                return True
        return False

    def _work_slot(self, committed: int, j: int) -> int:
        """Work slot j (1..k-1) of the request on committed slot `committed`: the state after its draft j."""
        return self.max_num_seqs + committed * (self.k - 1) + j - 1

    def _reuse_accepted(self, rows: Sequence[_Row]) -> None:
        """Where a request's new tokens start with a of its last drafts (a <= k - 1, and at least one new token left
        to compute, for the logits of draft 1), take the state after them from work slot a: P += a."""
        copies = []
        for row in rows:
            state = row.state
            drafts, state.folded_drafts = state.folded_drafts, []
            new = state.request.token_slice(state.num_folded, row.num_tokens)
            a = 0
            while a < min(len(drafts), len(new) - 1) and new[a] == drafts[a]:
                a += 1
            if a:
                slot = self.cache.slot(state.request.request_id)
                copies.append((self._work_slot(slot, a), slot))
                state.num_folded += a
                state.last_logits = None
        self.runner.apply_copies([], copies)

    def _catch_up(self, rows: Sequence[_Row]) -> torch.Tensor:
        """Fold tokens [P, N) of every row into its committed slot, under the token budget per forward; returns the
        fp32 [len(rows), vocab] logits after the N tokens."""
        pending = list(range(len(rows)))
        while True:
            todo = [i for i in pending if rows[i].state.num_folded < rows[i].num_tokens]
            if not todo:
                break
            budget, chunks, ends = self.max_num_batched_tokens, [], []
            for i in todo:  # at least one chunk per forward, so a budget of 1 still makes progress
                if budget <= 0:
                    break
                state, request = rows[i].state, rows[i].state.request
                start = state.num_folded
                end = min(rows[i].num_tokens, start + budget)
                budget -= end - start
                chunks.append(ScheduledChunk(
                    request_id=request.request_id, new_token_ids=request.token_slice(start, end),
                    num_computed_tokens=start, state_slot=self.cache.slot(request.request_id),
                    block_ids=self.cache.block_ids(request.request_id), reset_state=start == 0))
                ends.append((i, end))
            logits = self.runner.execute_model(chunks)
            for (i, end), row in zip(ends, logits, strict=True):
                rows[i].state.num_folded = end
                if end == rows[i].num_tokens:
                    rows[i].state.last_logits = row
        last = [r.state.last_logits for r in rows]
        if any(t is None for t in last):  # P == N is only ever reached by a catch-up, which sets them
            raise RuntimeError("draft state without logits after its catch-up")
        return torch.stack(last)  # type: ignore[arg-type]

    def _pick(self, rows: Sequence[_Row], active: Sequence[int], logits: torch.Tensor, drafts: list[list[int]],
              probs: list[list[torch.Tensor]]) -> None:
        """Append the next draft token of each active row: the argmax, or a draw from the row's q (kept in probs)."""
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [a for a, i in enumerate(active) if rows[i].sampled]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            params = [rows[active[a]].state.request.params for a in sampled]
            q = draft_distribution(logits.index_select(0, idx), params)
            gens = [rows[active[a]].state.generator or self.generator for a in sampled]
            # One row at a time: each row's draw depends only on its own generator (reproducible per seed).
            for a, row_q, gen in zip(sampled, q, gens, strict=True):
                tokens[a] = int(sampling_ops.random_sample(row_q[None], [gen])[0])
                probs[active[a]].append(row_q.float().cpu())
        for a, i in enumerate(active):
            drafts[i].append(tokens[a])
