"""Step hooks: components that attach to every engine step without the core knowing their feature.

The core calls, each step, in order: `before_schedule` (requests to queue or end, proposals), `after_schedule`
(per-step data for the workers, such as grammar bitmasks), and `after_update` (what the sampled tokens mean to the
component: a grammar advances, and may end a request). Grammars are one hook (`GrammarHook`), proposers another
(`ProposerHook`); KV connectors will be a third.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from deltaserve.engine.messages import EngineCoreOutput
from deltaserve.request import FinishReason
from deltaserve.scheduler.output import RunnerOutput, SchedulerOutput
from deltaserve.scheduler.scheduler import Scheduler, StepEvent
from deltaserve.spec_decode.adaptive import AdaptiveVerifier
from deltaserve.spec_decode.metrics import SpecDecodeStats
from deltaserve.spec_decode.proposer import Proposal, Proposer, WorkerDraftedProposer
from deltaserve.structured.backend import Grammar
from deltaserve.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class StepHook(Protocol):
    """A component attached to every engine step."""

    def before_schedule(self) -> list[EngineCoreOutput]:
        """Before the scheduler runs; returns outputs for requests the hook ended (each with its error)."""
        ...

    def after_schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """What the workers get (the hook may attach its per-step data)."""
        ...

    def after_update(self, events: list[StepEvent], result: RunnerOutput) -> dict[str, str]:
        """After the scheduler took the step's tokens (`result`: what the workers returned); returns
        {request id: error} for requests it ended."""
        ...


class GrammarHook:
    """Structured output: requests wait for their grammar to compile, constrained rows get its token bitmask, and
    each grammar advances once per generated token (never on a recompute)."""

    def __init__(self, scheduler: Scheduler, structured: StructuredOutputManager) -> None:
        self.scheduler, self.structured = scheduler, structured
        self.grammars: dict[str, Grammar] = {}
        """The grammar of every constrained request in the scheduler, by request id."""

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's grammar (unknown ids are ignored)."""
        self.grammars.pop(request_id, None)

    def before_schedule(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar is ready; finish those whose compile failed, one output each."""
        if not self.structured.num_pending:
            return []
        compiled, failed = self.structured.take_finished()
        for request, grammar in compiled:
            self.grammars[request.request_id] = grammar
            self.scheduler.add_request(request)
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], logprobs=[],
                                 finish_reason=FinishReason.ERROR, error=message) for r, message in failed]

    def after_schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """Attach the token bitmask of every constrained request that samples this step (none: `out` unchanged):
        one row, or with proposed tokens one row per verified position (the grammar advanced over the proposals
        before it, then rolled back: it advances for real over the accepted tokens only, in `after_update`)."""
        chunks = [c for c in out.chunks if c.sample and c.request_id in self.grammars]
        if not chunks:
            return out
        grammars = [self.grammars[c.request_id] for c in chunks]
        if any(c.num_proposed for c in chunks):
            bitmask = self.structured.bitmask_along(
                [(g, c.new_token_ids[len(c.new_token_ids) - c.num_proposed:]) for g, c in zip(grammars, chunks,
                                                                                             strict=True)])
        else:
            bitmask = self.structured.bitmask(grammars)
        return replace(out, structured_request_ids=[c.request_id for c in chunks], grammar_bitmask=bitmask)

    def after_update(self, events: list[StepEvent], result: RunnerOutput) -> dict[str, str]:
        """Feed every constrained request its new tokens. A token the grammar rejects finishes the request with an
        error; a finished request's grammar is dropped."""
        rejected: dict[str, str] = {}
        for e in events:
            request = e.request
            grammar = self.grammars.get(request.request_id)
            if grammar is None:
                continue
            for token in e.tokens if e.finish_reason is None else e.tokens[:-1]:
                if not grammar.accept_token(token.token_id):
                    rejected[request.request_id] = f"the structured-output grammar rejected token {token.token_id}"
                    logger.error("request %s: %s", request.request_id, rejected[request.request_id])
                    self.scheduler.finish_request(request.request_id, FinishReason.ERROR)
                    break
            if request.is_finished:
                self.forget(request.request_id)
        return rejected


class ProposerHook:
    """Speculative decoding: before each step, ask the proposer for the next tokens of every decoding request; the
    scheduler verifies them in the step. With a `verifier` (adaptive verification), proposals with confidences are
    cut to the positions worth verifying at this load, and the workers draft for the next step only while
    speculation can win (`SchedulerOutput.propose_drafts`). A constrained request's proposals are cut at the first
    token its grammar rejects. Counts drafts and accepted tokens (`stats`). Drafts made on the workers (a block
    drafter's) reach the proposer from each step's result."""

    def __init__(self, scheduler: Scheduler, proposer: Proposer, grammars: Mapping[str, Grammar], *,
                 disable_by_batch_size: int | None = None, verifier: AdaptiveVerifier | None = None) -> None:
        self.scheduler, self.proposer, self.grammars = scheduler, proposer, grammars
        self.disable_by_batch_size, self.verifier = disable_by_batch_size, verifier
        self.stats = SpecDecodeStats()
        self._probs: dict[str, torch.Tensor] = {}
        self._confidences: dict[str, tuple[float, ...]] = {}
        """This step's offered confidences per request (what the verifier learns calibration from)."""
        self._num_probes = 0
        self._step_shape: tuple[int, int, bool] | None = None
        """This step's (sampling rows, mean context, any proposals) for `observe_step`; None: a prefill step."""

    def forget(self, request_id: str) -> None:
        """A request ended (finished or aborted): the proposer drops what it keeps for it."""
        self._probs.pop(request_id, None)
        self.proposer.forget(request_id)

    def before_schedule(self) -> list[EngineCoreOutput]:
        self._probs, self._confidences = {}, {}
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        limit = self.disable_by_batch_size
        if not decoding or (limit is not None and len(self.scheduler.running) >= limit):
            for request in decoding:
                request.spec_token_ids = []
            return []
        proposals = self.proposer.propose(decoding)
        if self.verifier is not None:
            proposals = self._adapt(proposals)
        k = self.proposer.num_speculative_tokens
        for request in decoding:
            proposal = proposals.get(request.request_id)
            tokens = list(proposal.token_ids[:k]) if proposal is not None else []
            grammar = self.grammars.get(request.request_id)
            if grammar is not None and tokens:
                tokens = tokens[:grammar.validate_tokens(tokens)]
            request.spec_token_ids = tokens
            if tokens and proposal is not None and proposal.probs is not None:
                self._probs[request.request_id] = proposal.probs
            if tokens and proposal is not None and proposal.confidences is not None:
                self._confidences[request.request_id] = proposal.confidences
        return []

    def _adapt(self, proposals: dict[str, Proposal]) -> dict[str, Proposal]:
        """Proposals cut to the verifier's choice (those without confidences stay whole). Only ever shortens them:
        which drafts are offered changes no output."""
        assert self.verifier is not None
        scored = [r for r in self.scheduler.running
                  if (p := proposals.get(r.request_id)) is not None and p.confidences]
        if not scored:
            return proposals
        ids = {r.request_id for r in scored}
        others = [r for r in self.scheduler.running if r.request_id not in ids]
        budget = self.scheduler.cfg.max_num_batched_tokens
        other_tokens = min(sum(r.num_tokens - r.num_computed_tokens for r in others), budget)
        lengths = self.verifier.choose([proposals[r.request_id].confidences or () for r in scored],
                                       [r.num_tokens for r in scored], num_other_seqs=len(others),
                                       num_other_tokens=max(other_tokens, len(others)))
        out = dict(proposals)
        for r, m in zip(scored, lengths, strict=True):
            p = proposals[r.request_id]
            out[r.request_id] = replace(p, token_ids=p.token_ids[:m], probs=None if p.probs is None else p.probs[:m],
                                        confidences=(p.confidences or ())[:m])
        return out

    def after_schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """Attach the draft distributions of the verified proposals that were drawn from one; say whether the
        workers draft for the next step: not while `disable_by_batch_size` stops proposals (its drafts would never
        be offered), and with a verifier only while drafting can win."""
        limit = self.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) >= limit:
            out = replace(out, propose_drafts=False)
        elif self.verifier is not None and out.chunks:
            # One pass over the chunks for `drafts_for` and `observe_step` (a step that drafts nothing pays only
            # this and the judgement's lookup).
            num_sampling = sampling_context = other_tokens = all_context = 0
            prefill = proposed = False
            for c in out.chunks:
                all_context += c.num_computed_tokens
                prefill = prefill or len(c.new_token_ids) > 1 + c.num_proposed
                proposed = proposed or c.num_proposed > 0
                if c.sample:
                    num_sampling += 1
                    sampling_context += c.num_computed_tokens
                else:
                    other_tokens += len(c.new_token_ids)
            drafting = num_sampling and self.verifier.drafts_for(
                num_sampling, round(sampling_context / num_sampling), num_other_seqs=len(out.chunks) - num_sampling,
                num_other_tokens=other_tokens)
            if not drafting:
                out = replace(out, propose_drafts=False)
            elif drafting < num_sampling:  # a probe: requests in turn
                self._num_probes += 1
                ids = [c.request_id for c in out.chunks if c.sample]
                out = replace(out, draft_only=tuple(ids[(self._num_probes + i) % num_sampling]
                                                    for i in range(drafting)))
            self._step_shape = None if prefill else (num_sampling, round(all_context / len(out.chunks)), proposed)
        if not self._probs:
            return out
        probs = {c.request_id: self._probs[c.request_id][:c.num_proposed] for c in out.chunks
                 if c.num_proposed and c.request_id in self._probs}
        return replace(out, draft_probs=probs) if probs else out

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step took `seconds` in all: the verifier corrects its cost model with it (not with a step that had a
        prefill chunk: far outside the cost model's grid of 1 to k + 1 tokens a row, no evidence)."""
        shape, self._step_shape = self._step_shape, None
        if self.verifier is None or shape is None or not out.chunks:
            return
        num_sampling, context, proposed = shape
        drafting = 0 if not out.propose_drafts else num_sampling if out.draft_only is None else len(out.draft_only)
        self.verifier.observe_step(len(out.chunks), out.num_tokens, context, seconds, num_drafting=drafting,
                                   verified=proposed)

    def after_update(self, events: list[StepEvent], result: RunnerOutput) -> dict[str, str]:
        if result.drafts and isinstance(self.proposer, WorkerDraftedProposer):
            self.proposer.receive(result.drafts)
        observed = [e for e in events if e.num_proposed and e.request.request_id in self._confidences]
        if self.verifier is not None and observed:
            self.verifier.observe([e.num_proposed for e in observed], [e.num_accepted for e in observed],
                                  [self._confidences[e.request.request_id] for e in observed])
        for e in events:
            self.stats.observe(e.num_proposed, e.num_accepted)
            if e.request.is_finished:
                self.forget(e.request.request_id)
        return {}
