"""`BlockDrafting`: the block drafter's side of a worker step (speculative method `dspark`).

After the target's forward, every chunk's tapped features (`FeatureTaps`) at the positions it committed (a prefill
chunk's tokens; a verification's tokens up to its last accepted draft, never a rejected one) go into its request's
context window: the last `context_window` positions, kept contiguous (a chunk that does not continue the window,
such as a recompute after preemption or a prompt starting after a prefix-cache hit, starts it afresh). After
sampling, one batched drafter forward proposes the next block of every sampled request from its window and its
last sampled token: the drafts go back to the engine (`RunnerOutput.drafts`) with their confidences, and the
distributions sampled drafts were drawn from stay here, to verify them in the next step (`with_kept_probs`).

Windows are folded lazily: a step only keeps its taps and what says which rows each request committed
(`_StepFeatures`), folded into the windows when a step drafts. While the adaptive verifier keeps drafting off (high
load), a step so costs a few list appends instead of a tensor copy per request (2026-12-07: the per-request window
updates were ~4% of a batch-16 step that drafted nothing). Only the last `context_window` steps are kept: a request
decoding in each of them has its whole window there, and one that was not (a record dropped) restarts its window
from what is left, which changes drafts, never outputs.

Draft sampling: greedy requests, or every request with `draft_sample_method="greedy"`, get the drafter's argmax at
each row; otherwise row j is drawn from q_j = the drafter's distribution with the request's temperature and top-k /
top-p / min-p, by the request's own draft generator (seeded requests) or the runner's. The rows of a block are
drawn independently (q_j does not depend on the drafts before it), which rejection sampling accepts as any
proposal distribution. Confidence of a draft: its probability under the drafter (q_j, or the untempered softmax for
argmax drafts).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from deltaserve.models.dspark import DSparkDrafter, draft_logits, request_bytes
from deltaserve.models.protocol import Model
from deltaserve.ops import sampling as sampling_ops
from deltaserve.runner.draft_distribution import draft_distribution, draft_seed
from deltaserve.runner.drafter_graphs import DrafterGraphs
from deltaserve.runner.feature_taps import FeatureTaps
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import BlockDraft, SampledToken, ScheduledChunk, SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each chunk's rows lie in the last forward's flattened batch."""

    cu_seqlens: Sequence[int]
    """Sequence row r spans [cu_seqlens[r], cu_seqlens[r + 1])."""
    row_of_chunk: Sequence[int]
    """Chunk index (in scheduled order) -> its sequence row."""


@dataclass(slots=True)
class _Kept:
    """The last drafts of a request, with the distributions they were drawn from (None: argmax drafts)."""

    token_ids: list[int]
    probs: torch.Tensor | None
    num_tokens: int


@dataclass(frozen=True, slots=True)
class _StepFeatures:
    """One step's taps and what says which of their rows each request committed, not yet folded into the windows
    (references only: a step that does not draft does no per-request work)."""

    taps: tuple[torch.Tensor, ...]
    """The step's tapped layer outputs, ``[T, d]`` each (concatenated, ``[T, F]``, only when folded)."""
    chunks: Sequence[ScheduledChunk]
    sampled: Mapping[str, list[SampledToken]]
    layout: StepLayout

    def spans(self) -> Iterator[tuple[str, int, int, int]]:
        """Per chunk: (request id, position of its first committed row, that row in `taps`, rows committed)."""
        cu, row_of_chunk = self.layout.cu_seqlens, self.layout.row_of_chunk
        for i, c in enumerate(self.chunks):
            tokens = self.sampled.get(c.request_id)
            accepted = len(tokens) - 1 if tokens and c.num_proposed else 0
            yield (c.request_id, c.num_computed_tokens, cu[row_of_chunk[i]],
                   len(c.new_token_ids) - c.num_proposed + accepted)


@dataclass(slots=True)
class _Context:
    """One request's window of target features."""

    features: torch.Tensor
    """``[W, F]`` newest last; the last `num_valid` rows are real."""
    num_valid: int = 0
    next_position: int = 0
    """The position whose features would extend the window."""
    generator: torch.Generator | None = None
    kept: _Kept | None = None


class BlockDrafting:
    """Per-request feature windows and the drafter's forward, inside a `ModelRunner`."""

    def __init__(self, drafter: DSparkDrafter, model: Model, *, sample_method: str, seed: int,
                 compiled: bool = False) -> None:
        """`compiled`: run the drafter's forward through `DrafterGraphs` (a CPU: compiled per batch bucket in the
        background, eager until then)."""
        self.drafter, self.model, self.sample_method = drafter, model, sample_method
        self.forward: DSparkDrafter | DrafterGraphs = DrafterGraphs(drafter) if compiled else drafter
        cfg = drafter.config
        self.window, self.block_size, self.feature_size = cfg.context_window, cfg.block_size, cfg.feature_size
        self.taps = FeatureTaps(model, cfg.tap_layers)
        self.device = next(model.parameters()).device
        self.dtype = next(drafter.parameters()).dtype
        self.generator = torch.Generator(device=self.device).manual_seed(draft_seed(seed))
        self._contexts: dict[str, _Context] = {}
        self._unfolded: deque[_StepFeatures] = deque(maxlen=self.window)
        self._forgotten: set[str] = set()
        """Requests forgotten while records of them may remain unfolded (their spans are skipped)."""
        self._num_kept = 0
        """Contexts holding kept drafts (none: `with_kept_probs` has nothing to look up)."""

    def forget(self, request_id: str) -> None:
        """Drop a finished request's window and drafts (unknown ids are ignored)."""
        ctx = self._contexts.pop(request_id, None)
        if ctx is not None and ctx.kept is not None:
            self._num_kept -= 1
        if self._unfolded:
            self._forgotten.add(request_id)
            if len(self._forgotten) > 64 * self.window:  # drafting off for long: keep only ids still recorded
                recorded = {c.request_id for step in self._unfolded for c in step.chunks}
                self._forgotten &= recorded

    def with_kept_probs(self, out: SchedulerOutput) -> SchedulerOutput:
        """`out` with the kept draft distributions of the chunks that verify exactly the drafts this runner made
        (a prefix of them: the engine may offer fewer). Other proposals are verified as deterministic tokens, which
        is lossless for any proposal, only less likely to accept."""
        if not self._num_kept:
            return out
        probs = {}
        for c in out.chunks:
            m = c.num_proposed
            if not m:
                continue
            ctx = self._contexts.get(c.request_id)
            kept = None if ctx is None else ctx.kept
            if (kept is None or kept.probs is None or c.request_id in out.draft_probs
                    or c.num_computed_tokens + len(c.new_token_ids) - m != kept.num_tokens
                    or c.new_token_ids[-m:] != kept.token_ids[:m]):
                continue
            probs[c.request_id] = kept.probs[:m]
        return dataclasses.replace(out, draft_probs={**out.draft_probs, **probs}) if probs else out

    def after_step(self, chunks: Sequence[ScheduledChunk], sampled: Mapping[str, list[SampledToken]],
                   layout: StepLayout, params: Mapping[str, SamplingParams], *, propose: bool,
                   only: Collection[str] | None = None) -> dict[str, BlockDraft]:
        """Record the step's committed features; then (when `propose`) fold them into the windows and draft for
        every sampled request (of `only`, when given). `params`: the sampling settings of each request to draft
        for (read only when proposing)."""
        taps = self.taps.take_parts()
        if self._num_kept:
            for c in chunks:  # their kept drafts were verified (or dropped) by this step
                ctx = self._contexts.get(c.request_id)
                if ctx is not None and ctx.kept is not None:
                    ctx.kept = None
                    self._num_kept -= 1
        if self._forgotten:  # a forgotten id scheduled again is a new request (its own spans count)
            self._forgotten.difference_update(c.request_id for c in chunks)
        self._unfolded.append(_StepFeatures(taps, chunks, sampled, layout))
        rows = [(c.request_id, c.num_computed_tokens + len(c.new_token_ids) - c.num_proposed
                 + len(sampled[c.request_id])) for c in chunks
                if sampled.get(c.request_id) and (only is None or c.request_id in only)] if propose else []
        # A step with more rows than verifying decodes have (a prefill chunk) folds at once: its taps are mostly rows
        # no window keeps, not to be held for later, and its forward dwarfs a fold.
        if not rows and taps[0].shape[0] <= (self.block_size + 1) * len(chunks):
            return {}
        with torch.inference_mode():
            self._fold()
            return self._draft(rows, sampled, params) if rows else {}

    def _fold(self) -> None:
        """Fold the recorded steps, oldest first, into the windows (a span that does not continue its request's
        window, or follows a dropped record, starts the window afresh)."""
        pieces: dict[str, list[torch.Tensor]] = {}
        for step in self._unfolded:
            taps = torch.cat(step.taps, dim=-1)
            for rid, position, start, n in step.spans():
                if rid in self._forgotten:
                    continue
                ctx = self._contexts.get(rid)
                if ctx is None:
                    ctx = self._contexts[rid] = _Context(
                        torch.zeros(self.window, self.feature_size, dtype=self.dtype, device=self.device))
                if position != ctx.next_position:
                    ctx.num_valid = 0
                    pieces.pop(rid, None)
                ctx.next_position = position + n
                if n:
                    pieces.setdefault(rid, []).append(taps[start + max(n - self.window, 0):start + n])
                    ctx.num_valid = min(self.window, ctx.num_valid + n)
        self._unfolded.clear()
        self._forgotten.clear()
        for rid, parts in pieces.items():
            rows = (torch.cat(parts) if len(parts) > 1 else parts[0])[-self.window:]
            ctx = self._contexts[rid]
            ctx.features = torch.cat([ctx.features[rows.shape[0]:], rows.to(self.dtype)])

    def _draft(self, rows: Sequence[tuple[str, int]], sampled: Mapping[str, list[SampledToken]],
               params: Mapping[str, SamplingParams]) -> dict[str, BlockDraft]:
        contexts = [self._contexts[rid] for rid, _ in rows]
        features = torch.stack([c.features for c in contexts])
        valid = torch.arange(self.window, device=self.device)[None, :] >= torch.tensor(
            [self.window - c.num_valid for c in contexts], device=self.device)[:, None]
        first = torch.tensor([sampled[rid][-1].token_id for rid, _ in rows], device=self.device)
        model = self.model
        logits = draft_logits(self.forward, features, valid, first, model.embed, model.compute_logits)  # [B, k, V]
        k = self.block_size
        tokens = torch.empty(len(rows), k, dtype=torch.long, device=self.device)
        conf = torch.empty(len(rows), k, device=self.device)
        probs: list[torch.Tensor | None] = [None] * len(rows)
        greedy = [b for b, (rid, _) in enumerate(rows) if params[rid].greedy or self.sample_method == "greedy"]
        if greedy:
            idx = torch.tensor(greedy, device=self.device)
            top, picked = logits.index_select(0, idx).softmax(dim=-1).max(dim=-1)
            conf.index_copy_(0, idx, top)
            tokens.index_copy_(0, idx, picked)
        chosen = set(greedy)
        drawn = [b for b in range(len(rows)) if b not in chosen]
        if drawn:
            # One batched q for every drawn row of every block; each row is drawn by its request's generator.
            idx = torch.tensor(drawn, device=self.device)
            row_params = [params[rows[b][0]] for b in drawn for _ in range(k)]
            q = draft_distribution(logits.index_select(0, idx).flatten(0, 1), row_params)  # [S * k, V]
            gens = [self._generator(contexts[b], params[rows[b][0]]) for b in drawn for _ in range(k)]
            picked = sampling_ops.random_sample(q, gens)
            conf.index_copy_(0, idx, q.gather(1, picked[:, None]).view(len(drawn), k))
            tokens.index_copy_(0, idx, picked.view(len(drawn), k))
            q = q.view(len(drawn), k, -1)
            for n, b in enumerate(drawn):
                probs[b] = q[n]
        out = {}
        for b, ((rid, num_tokens), ctx, ids, c) in enumerate(zip(rows, contexts, tokens.tolist(), conf.tolist(),
                                                                strict=True)):
            if ctx.kept is None:
                self._num_kept += 1
            ctx.kept = _Kept(ids, probs[b], num_tokens)
            out[rid] = BlockDraft(tuple(ids), tuple(c), num_tokens)
        return out

    def _generator(self, ctx: _Context, params: SamplingParams) -> torch.Generator:
        """The request's own draft generator (seeded requests), else the runner's."""
        if params.seed is not None and ctx.generator is None:
            ctx.generator = torch.Generator(device=self.device).manual_seed(draft_seed(params.seed))
        return ctx.generator or self.generator

    @torch.inference_mode()
    def time_draft(self, num_seqs: int) -> float:
        """Seconds of one drafter forward (and LM head) for `num_seqs` requests with full windows (the adaptive
        verifier's cost model, measured at start-up)."""
        features = torch.zeros(num_seqs, self.window, self.feature_size, dtype=self.dtype, device=self.device)
        valid = torch.ones(num_seqs, self.window, dtype=torch.bool, device=self.device)
        first = torch.zeros(num_seqs, dtype=torch.long, device=self.device)
        start = time.perf_counter()
        logits = draft_logits(self.forward, features, valid, first, self.model.embed, self.model.compute_logits)
        logits.argmax(dim=-1).tolist()  # waits for the device
        return time.perf_counter() - start

    @property
    def bytes_per_request(self) -> int:
        """Memory one request holds here: its feature window and its kept draft distributions."""
        return request_bytes(self.drafter.config, torch.tensor([], dtype=self.dtype).element_size())
