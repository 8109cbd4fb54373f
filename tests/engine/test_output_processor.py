"""`OutputProcessor` against a scripted `EngineClient` (no model): n fan-out with child seeds, stop strings end a
sequence early with an abort, the first engine error ends every sequence, closing early aborts, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from deltaserve.default_model import default_model_dir
from deltaserve.engine.messages import EngineCoreOutput, EngineInfo
from deltaserve.engine.output_processor import OutputProcessor, SequenceUpdate, TextProcessor, merge
from deltaserve.engine.protocol import EngineClient, EngineRequestError
from deltaserve.engine.stats import EngineStats
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams, child_seed
from deltaserve.text.tokenizer import Tokenizer

TEXT = "one two three four five six seven eight"


class ScriptedClient:
    """Yields each request's scripted outputs one token at a time (the last with LENGTH), or raises its error.
    Records the requests it was given and every abort."""

    def __init__(self, tokens: dict[str, list[int]], errors: dict[str, str] | None = None) -> None:
        self.info = EngineInfo(max_model_len=1024, vocab_size=4096, eos_token_ids=frozenset(), num_blocks=8,
                               num_state_slots=4, block_size=16)
        self.tokens, self.errors = tokens, errors or {}
        self.params: dict[str, SamplingParams] = {}
        self.aborts: list[tuple[str, FinishReason]] = []
        self.closed: list[str] = []
        self.started = asyncio.Event()
        self.hold: asyncio.Event | None = None
        """When set: a request with no script waits on it (a sequence that never finishes by itself)."""

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       eos_token_ids: frozenset[int] = frozenset(), priority: int = 0, session_id: str | None = None,
                       kv_transfer_params: dict | None = None, images: tuple = ()
                       ) -> AsyncGenerator[EngineCoreOutput, None]:
        self.params[request_id] = params
        self.started.set()
        try:
            if request_id in self.errors:
                raise EngineRequestError(self.errors[request_id])
            if request_id not in self.tokens:
                assert self.hold is not None
                await self.hold.wait()
            ids = self.tokens[request_id]
            for i, t in enumerate(ids):
                if any(rid == request_id for rid, _ in self.aborts):
                    yield EngineCoreOutput(request_id=request_id, new_token_ids=[], logprobs=[],
                                           finish_reason=self.aborts[-1][1])
                    return
                last = i == len(ids) - 1
                yield EngineCoreOutput(request_id=request_id, new_token_ids=[t], logprobs=[None],
                                       finish_reason=FinishReason.LENGTH if last else None, num_cached_tokens=3)
        finally:
            self.closed.append(request_id)

    async def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        self.aborts.append((request_id, reason))

    async def get_stats(self, *, reset_prefix_cache: bool = False) -> EngineStats:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        return True

    @property
    def num_unfinished(self) -> int:
        return 0

    async def shutdown(self) -> None:
        pass


class Metrics:
    def __init__(self) -> None:
        self.itl: list[float] = []
        self.finished: list[tuple[str, int, int]] = []

    def observe_itl(self, seconds: float) -> None:
        self.itl.append(seconds)

    def observe_finished(self, reason: str, *, prompt_tokens: int, generated: int, ttft: float | None,
                         e2e: float) -> None:
        assert ttft is not None and e2e >= ttft
        self.finished.append((reason, prompt_tokens, generated))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(str(default_model_dir()))


def run_all(processor: OutputProcessor, tok: Tokenizer, params: SamplingParams, request_id: str = "r"
            ) -> list[SequenceUpdate]:
    async def scenario() -> list[SequenceUpdate]:
        updates = processor.generate(request_id, [1, 2, 3], params, lambda p: TextProcessor(tok, p))
        return [u async for u in updates]

    return asyncio.run(scenario())


def joined(updates: list[SequenceUpdate], index: int) -> str:
    return "".join(u.delta.content for u in updates if u.index == index)


def test_fan_out_gives_each_sequence_its_id_seed_and_text(tok):
    """n=2: engine requests r-0 and r-1 with n=1 and child seeds; each sequence's text is its tokens' text, its
    last update says 'length'."""
    ids = tok.encode(TEXT)
    client = ScriptedClient({"r-0": ids, "r-1": ids[::-1]})
    metrics = Metrics()
    processor = OutputProcessor(client, eos_token_ids=frozenset({7}), metrics=metrics)
    updates = run_all(processor, tok, SamplingParams(n=2, seed=11, max_tokens=len(ids)))
    assert {rid: (p.n, p.seed) for rid, p in client.params.items()} == {"r-0": (1, 11), "r-1": (1, child_seed(11, 1))}
    assert joined(updates, 0) == tok.decode(ids) and joined(updates, 1) == tok.decode(ids[::-1])
    for index in (0, 1):
        mine = [u for u in updates if u.index == index]
        assert [u.finish_reason for u in mine] == [None] * (len(ids) - 1) + ["length"]
        assert [t for u in mine for t in u.token_ids] == (ids if index == 0 else ids[::-1])
    assert sorted(metrics.finished) == [("length", 0, len(ids)), ("length", 3, len(ids))]
    assert len(metrics.itl) == 2 * (len(ids) - 1) and client.aborts == []


def test_stop_string_aborts_with_stop_and_cuts_the_text(tok):
    """A stop string ends the sequence at once: the engine request is aborted with STOP, the last update carries
    'stop' and the stop string, and the text ends before it."""
    ids = tok.encode(TEXT)
    client = ScriptedClient({"r": ids})
    updates = run_all(OutputProcessor(client, eos_token_ids=frozenset()), tok,
                      SamplingParams(stop=["four"], max_tokens=len(ids)))
    assert client.aborts == [("r", FinishReason.STOP)]
    assert (updates[-1].finish_reason, updates[-1].stop_string) == ("stop", "four")
    assert joined(updates, 0) == "one two three "
    assert client.closed == ["r"]


class BurstClient(ScriptedClient):
    """Delivers each request's tokens `per_step` at a time (a speculative step), with logprob markers."""

    per_step = 3

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       eos_token_ids: frozenset[int] = frozenset(), priority: int = 0, session_id: str | None = None,
                       kv_transfer_params: dict | None = None, images: tuple = ()
                       ) -> AsyncGenerator[EngineCoreOutput, None]:
        ids = self.tokens[request_id]
        for i in range(0, len(ids), self.per_step):
            part = ids[i:i + self.per_step]
            yield EngineCoreOutput(request_id=request_id, new_token_ids=part, logprobs=[None] * len(part),
                                   finish_reason=FinishReason.LENGTH if i + self.per_step >= len(ids) else None)


@pytest.mark.parametrize("stop", ["four", "eight", "one"])
def test_a_stop_string_inside_a_multi_token_output_cuts_its_tokens(tok, stop):
    """When a stop string ends inside a step's several tokens, the tokens (and logprobs) after the one that
    completed it are dropped with the text, and the reason is 'stop' (or the engine's, when the stop string ends
    on the last token): the same as one token per step."""
    ids = tok.encode(TEXT)
    params = SamplingParams(stop=[stop], max_tokens=len(ids))
    plain = run_all(OutputProcessor(ScriptedClient({"r": ids}), eos_token_ids=frozenset()), tok, params)
    burst = run_all(OutputProcessor(BurstClient({"r": ids}), eos_token_ids=frozenset()), tok, params)
    assert [t for u in burst for t in u.token_ids] == [t for u in plain for t in u.token_ids]
    assert sum(len(u.logprobs) for u in burst) == sum(len(u.token_ids) for u in burst)
    assert joined(burst, 0) == joined(plain, 0)
    assert (burst[-1].finish_reason, burst[-1].stop_string) == (plain[-1].finish_reason, stop)
    assert stop == "eight" or burst[-1].finish_reason == "stop"  # "eight" ends the text: the engine's LENGTH


def test_an_engine_error_ends_every_sequence(tok):
    """One sequence's EngineRequestError is raised to the caller and closes the other sequence's stream."""
    client = ScriptedClient({}, errors={"r-1": "grammar failed"})
    client.hold = asyncio.Event()  # r-0 never finishes by itself
    with pytest.raises(EngineRequestError, match="grammar failed"):
        run_all(OutputProcessor(client, eos_token_ids=frozenset()), tok, SamplingParams(n=2))
    assert sorted(client.closed) == ["r-0", "r-1"]


def test_closing_early_closes_every_engine_stream(tok):
    """Leaving the update stream after the first update closes both sequences' engine streams (which aborts them
    in a real client)."""
    ids = tok.encode(TEXT)
    client = ScriptedClient({"r-0": ids, "r-1": ids})

    async def scenario() -> None:
        updates = OutputProcessor(client, eos_token_ids=frozenset()).generate(
            "r", [1], SamplingParams(n=2), lambda p: TextProcessor(tok, p))
        await anext(updates)
        await updates.aclose()

    asyncio.run(scenario())
    assert sorted(client.closed) == ["r-0", "r-1"]


def test_merge_tags_items_with_their_stream_and_raises_the_first_error():
    async def numbers(values: list[int], error: Exception | None = None) -> AsyncGenerator[int, None]:
        for v in values:
            yield v
        if error is not None:
            raise error

    async def scenario() -> list[tuple[int, int]]:
        return [item async for item in merge([numbers([1, 2]), numbers([3])])]

    assert sorted(asyncio.run(scenario())) == [(0, 1), (0, 2), (1, 3)]

    async def failing() -> None:
        async for _ in merge([numbers([1]), numbers([], ValueError("boom"))]):
            pass

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(failing())


def test_scripted_client_satisfies_the_protocol():
    client: EngineClient = ScriptedClient({})
    assert client.is_alive
