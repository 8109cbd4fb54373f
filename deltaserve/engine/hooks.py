"""Step hooks: components that attach to every engine step without the core knowing their feature.

The core calls, each step, in order: `before_schedule` (requests to queue or end, proposals), `after_schedule`
(per-step data for the workers, such as grammar bitmasks), and `after_update` (what the sampled tokens mean to the
component: a grammar advances, and may end a request). Grammars are one hook (`GrammarHook`), proposers another
(`ProposerHook`); KV connectors will be a third.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from deltaserve.engine.messages import EngineCoreOutput
from deltaserve.request import FinishReason
from deltaserve.scheduler.output import SchedulerOutput
from deltaserve.scheduler.scheduler import Scheduler, StepEvent
from deltaserve.spec_decode.metrics import SpecDecodeStats
from deltaserve.spec_decode.proposer import Proposer
from deltaserve.structured.backend import Grammar
from deltaserve.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class StepHook(Protocol):
    """A component attached to every engine step."""

    def before_schedule(self) -> list[EngineCoreOutput]:
        """Before the scheduler runs; returns outputs for requests the hook ended (each with its error)."""
        ...

    def after_schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """What the workers get (the hook may attach its per-step data)."""
        ...

    def after_update(self, events: list[StepEvent]) -> dict[str, str]:
        """After the scheduler took the step's tokens; returns {request id: error} for requests it ended."""
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
        """Attach the token bitmask of every constrained request that samples this step (none: `out` unchanged)."""
        ids = [c.request_id for c in out.chunks if c.sample and c.request_id in self.grammars]
        if not ids:
            return out
        bitmask = self.structured.bitmask([self.grammars[rid] for rid in ids])
        return replace(out, structured_request_ids=ids, grammar_bitmask=bitmask)

    def after_update(self, events: list[StepEvent]) -> dict[str, str]:
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
    """Speculative decoding: before each step, ask the proposer for the next tokens of every decoding request that
    no grammar constrains; the scheduler verifies them in the step."""

    def __init__(self, scheduler: Scheduler, proposer: Proposer) -> None:
        self.scheduler, self.proposer = scheduler, proposer
        self.stats = SpecDecodeStats()
        """Acceptance counters (vLLM's spec-decode metrics), read by `EngineCore.get_stats`."""
        self._verifying: dict[str, list[int]] = {}
        """This step's proposed tokens by request id, as scheduled."""

    def before_schedule(self) -> list[EngineCoreOutput]:
        decoding = [r for r in self.scheduler.running
                    if r.num_tokens - r.num_computed_tokens == 1 and r.params.structured is None]
        if decoding:
            proposals = self.proposer.propose(decoding)
            k = self.proposer.num_speculative_tokens
            for request in decoding:
                proposal = proposals.get(request.request_id)
                request.spec_token_ids = list(proposal.token_ids[:k]) if proposal is not None else []
        return []

    def after_schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        self._verifying = {c.request_id: c.new_token_ids[-c.num_proposed:] for c in out.chunks if c.num_proposed}
        return out

    def after_update(self, events: list[StepEvent]) -> dict[str, str]:
        for e in events:
            proposed = self._verifying.get(e.request.request_id)
            if proposed:
                # Accepted: the leading tokens equal to the proposal (a sample equal to a proposed token is its
                # acceptance), counted on the tokens themselves so that a stop inside them still counts right.
                accepted = 0
                for token, proposal in zip(e.tokens, proposed, strict=False):
                    if token.token_id != proposal:
                        break
                    accepted += 1
                self.stats.observe(len(proposed), accepted)
        self._verifying = {}
        return {}
