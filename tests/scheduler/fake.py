"""A model-free runner for scheduler tests: the next token is a fixed function of the whole sequence so far.

Because the token depends on every earlier token, a scheduling bug that feeds a wrong chunk, skips tokens or loses
output after a preemption changes the outputs.
"""

from __future__ import annotations

from deltaserve.cache.manager import CacheManager
from deltaserve.config import SchedulerConfig
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import RunnerOutput, SampledToken, SchedulerOutput
from deltaserve.scheduler.scheduler import Scheduler

VOCAB = 1000


class FakeRunner:
    """Checks the chunks it receives against its own copy of each sequence and answers with a hash token."""

    def __init__(self, block_size: int = 4) -> None:
        self.block_size = block_size
        self.seen: dict[str, list[int]] = {}
        self.steps = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        sampled = {}
        used_blocks: dict[int, str] = {}
        for c in out.chunks:
            if c.reset_state:
                self.seen[c.request_id] = []
            seq = self.seen[c.request_id]
            assert len(seq) == c.num_computed_tokens, "chunk does not continue the cached tokens"
            seq.extend(c.new_token_ids)
            assert len(c.block_ids) * self.block_size >= len(seq), "too few blocks for the cached tokens"
            for b in c.block_ids:
                assert used_blocks.setdefault(b, c.request_id) == c.request_id, f"block {b} shared in one step"
            if c.sample:  # verify proposals as the runner does: accept while the sampled token equals them
                accepted = 0
                sampled[c.request_id] = [SampledToken(next_token(seq[:len(seq) - c.num_proposed]))]
                while accepted < c.num_proposed and sampled[c.request_id][-1].token_id == c.new_token_ids[1 + accepted]:
                    accepted += 1
                    sampled[c.request_id].append(SampledToken(next_token(seq[:len(seq) - c.num_proposed + accepted])))
                del seq[len(seq) - c.num_proposed + accepted:]  # rejected proposals were never computed
        return RunnerOutput(sampled=sampled)


def next_token(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def make_scheduler(*, num_blocks: int = 64, num_slots: int = 8, block_size: int = 4, clock=None, **cfg) -> Scheduler:
    cache = CacheManager(num_blocks=num_blocks, num_slots=num_slots, block_size=block_size)
    return Scheduler(SchedulerConfig(**cfg), cache, clock) if clock else Scheduler(SchedulerConfig(**cfg), cache)


_arrivals = iter(range(10**9))


def make_request(rid: str, prompt_len: int, max_tokens: int, *, priority: int = 0, stop=frozenset(),
                 max_total: int = 10_000, seed: int = 0) -> Request:
    prompt = [(seed * 131 + i * 17) % VOCAB for i in range(prompt_len)]
    return Request(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens),
                   stop_token_ids=frozenset(stop), arrival_index=next(_arrivals), priority=priority,
                   max_total_tokens=max_total)


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        out = sched.schedule()
        for ev in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(ev.request.request_id, []).extend(t.token_id for t in ev.tokens)
    raise AssertionError(f"not finished after {max_steps} steps")


def expected_output(req: Request) -> list[int]:
    seq, out = list(req.prompt_token_ids), []
    while len(out) < req.params.max_tokens:
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
        if tok in req.stop_token_ids:
            break
    return out
