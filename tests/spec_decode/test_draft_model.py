"""DraftModelProposer on tiny random checkpoints: a draft equal to the target is always accepted, a different draft
never changes greedy outputs, every draft block and slot is freed, and the committed state after catch-ups equals
a fresh prefill of the same tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from deltaserve.config import CacheConfig, EngineConfig, SchedulerConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec_decode import Proposal
from deltaserve.spec_decode.draft_model import DraftModelProposer
from tests.helpers import full_logits, prompt_ids, relative_error

K = 3
VOCAB = 1024  # the "base" tiny target's
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_dir) -> str:
    return str(tiny_dir("base"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    """A smaller draft of the same vocabulary: 1 KDA + 1 MLA layer, dense, other weights."""
    spec = TinySpec(layers=2, hidden=64, kda_heads=2, mla_heads=2, intermediate=128, first_k_dense=2, vocab=VOCAB,
                    seed=11)
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft"), spec))


def config(target: str, **scheduler: int) -> EngineConfig:
    sched = SchedulerConfig(**{"max_num_batched_tokens": 24, "max_num_seqs": 6, **scheduler})  # type: ignore[arg-type]
    # A fixed cache (no share of the machine's free memory): enough for every request of these tests at once.
    return EngineConfig(model=target, scheduler=sched, cache=CacheConfig(num_blocks=128, num_state_slots=6))


class Recording:
    """Wraps a proposer: keeps every proposal with the output length it was made at."""

    def __init__(self, inner: DraftModelProposer) -> None:
        self.inner = inner
        self.proposals: list[tuple[str, int, list[int]]] = []

    @property
    def num_speculative_tokens(self) -> int:
        return self.inner.num_speculative_tokens

    @property
    def memory_bytes(self) -> int:
        return self.inner.memory_bytes

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        out = self.inner.propose(requests)
        by_id = {r.request_id: r for r in requests}
        for rid, p in out.items():
            self.proposals.append((rid, len(by_id[rid].output_token_ids), list(p.token_ids)))
        return out


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]],
        abort_after: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Run to completion; a request in `abort_after` is aborted once it has at least that many output tokens."""
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    abort_after = dict(abort_after or {})
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None
            outputs[out.request_id].extend(out.new_token_ids)
        for rid, n in list(abort_after.items()):
            if len(outputs[rid]) >= n:
                core.abort_request(rid)
                del abort_after[rid]
    return outputs


def mixed_requests(n: int = 6, params: SamplingParams = GREEDY) -> dict[str, tuple[list[int], SamplingParams]]:
    lengths = [3, 17, 40, 9, 33, 5, 26, 12]
    return {f"r{i}": (prompt_ids(VOCAB, lengths[i], seed=500 + i), params) for i in range(n)}


def assert_all_free(proposer: DraftModelProposer) -> None:
    usage = proposer.cache.usage()
    assert (usage.num_free_blocks, usage.num_free_slots) == (usage.num_blocks, usage.num_slots)
    assert not proposer._states


def test_draft_equal_to_target_is_always_fully_accepted(target):
    requests = mixed_requests()
    plain = run(EngineCore(config(target)), requests)
    cfg = config(target)
    proposer = Recording(DraftModelProposer(model=target, num_speculative_tokens=K, draft_sample_method="greedy",
                                            engine=cfg))
    core = EngineCore(cfg, proposer=proposer)
    assert run(core, requests) == plain
    assert proposer.proposals
    for rid, n_out, tokens in proposer.proposals:
        # Drafts continue prompt + output (whose last token is not computed yet): plain tokens n_out, n_out + 1, ...
        assert tokens == plain[rid][n_out:n_out + len(tokens)], rid
    # Every request near its end gets fewer drafts (room), otherwise k.
    assert max(len(t) for _, _, t in proposer.proposals) == K
    # The engine's acceptance counters agree: nothing was rejected.
    stats = core.get_stats()
    proposed = sum(len(t) for *_, t in proposer.proposals)  # the scheduler verifies fewer when the budget is short
    assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens <= proposed


@pytest.mark.parametrize("max_num_batched_tokens", [24, pytest.param(7, marks=pytest.mark.slow)])  # CI time
def test_different_draft_keeps_greedy_outputs(target, draft, max_num_batched_tokens):
    requests = mixed_requests(8)
    cfg = config(target, max_num_batched_tokens=max_num_batched_tokens)
    plain = run(EngineCore(cfg), requests)
    proposer = DraftModelProposer(model=draft, num_speculative_tokens=K, draft_sample_method="greedy", engine=cfg)
    core = EngineCore(cfg, proposer=proposer)
    assert run(core, requests) == plain
    proposer.propose([])  # frees what finished requests held, when the core did not call forget
    assert_all_free(proposer)


def test_aborts_and_forget_free_every_block_and_slot(target, draft):
    requests = mixed_requests(6)
    cfg = config(target)
    proposer = DraftModelProposer(model=draft, num_speculative_tokens=K, draft_sample_method="greedy", engine=cfg)
    core = EngineCore(cfg, proposer=proposer)
    run(core, requests, abort_after={"r1": 2, "r4": 5, "r5": 1})
    proposer.propose([])
    assert_all_free(proposer)
    # forget frees at once; unknown ids are ignored.
    reqs = [Request(request_id=rid, prompt_token_ids=p, params=GREEDY, stop_token_ids=frozenset(), arrival_index=i,
                    max_total_tokens=4096) for i, (rid, (p, _)) in enumerate(requests.items())]
    assert set(proposer.propose(reqs)) == set(requests)
    assert proposer.cache.usage().num_free_slots == proposer.max_num_seqs - len(reqs)
    for r in reqs:
        proposer.forget(r.request_id)
    proposer.forget("never-seen")
    assert_all_free(proposer)


def test_committed_state_equals_a_fresh_prefill(draft, target):
    """Catch-ups in pieces (budget 7), drafts written past N in between, steps that accept none, some or all of the
    drafts (their states are then taken from the work slots, not recomputed): the logits after the committed state
    always equal those of one fresh prefill of all the tokens."""
    cfg = config(target, max_num_batched_tokens=7)
    proposer = DraftModelProposer(model=draft, num_speculative_tokens=K, draft_sample_method="greedy", engine=cfg)
    request = Request(request_id="a", prompt_token_ids=prompt_ids(VOCAB, 30, seed=9), params=GREEDY,
                      stop_token_ids=frozenset(), arrival_index=0, max_total_tokens=4096)
    sampled = prompt_ids(VOCAB, 8, seed=10)
    for accepted in (0, 2, 1, 3, 0, 3):  # the drafts a step accepts; the target's own sampled token follows them
        proposal = proposer.propose([request])["a"]
        assert len(proposal.token_ids) == K and proposal.probs is None
        request.output_token_ids.extend([*proposal.token_ids[:accepted], sampled.pop()])
        state = proposer._states["a"]
        ids = request.prompt_token_ids + request.output_token_ids
        proposer.propose([request])
        assert state.num_folded == len(ids)
        assert state.last_logits is not None
        ref = full_logits(proposer.model, ids)[-1]
        assert relative_error(state.last_logits, ref) < 1e-4
        assert proposer.propose([request])["a"].token_ids[0] == int(ref.argmax())  # no new token: same draft 1


def test_sampled_drafts_come_with_their_distribution_and_are_reproducible(target, draft):
    cfg = config(target)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=20),
              SamplingParams(temperature=1.3, top_p=0.9, seed=4, max_tokens=20),
              SamplingParams(temperature=0.0, max_tokens=20),  # greedy: no probs
              SamplingParams(temperature=1.0, seed=5, max_tokens=3)]  # room for one draft only

    def proposals() -> dict[str, Proposal]:
        proposer = DraftModelProposer(model=draft, num_speculative_tokens=K, engine=cfg)
        reqs = [Request(request_id=f"s{i}", prompt_token_ids=prompt_ids(VOCAB, 5 + 4 * i, seed=20 + i), params=p,
                        stop_token_ids=frozenset(), arrival_index=i, max_total_tokens=4096)
                for i, p in enumerate(params)]
        for r in reqs:
            r.output_token_ids.append(7)
        return proposer.propose(reqs)

    first, second = proposals(), proposals()
    for rid, p in first.items():
        assert p.token_ids == second[rid].token_ids
    assert first["s2"].probs is None and len(first["s2"].token_ids) == K
    assert len(first["s3"].token_ids) == 1
    for rid in ("s0", "s1", "s3"):
        probs = first[rid].probs
        assert probs is not None and probs.dtype == torch.float32 and probs.device.type == "cpu"
        assert probs.shape == (len(first[rid].token_ids), VOCAB)
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(probs)))
        assert all(probs[j, t] > 0 for j, t in enumerate(first[rid].token_ids))
        other = second[rid].probs
        assert other is not None and torch.equal(probs, other)
    s0 = first["s0"].probs
    assert s0 is not None and int((s0[0] > 0).sum()) <= 20  # top_k applied to q


def test_a_draft_of_another_vocabulary_is_refused(target, tiny_dir):
    with pytest.raises(ValueError, match="speculative_config.model"):
        DraftModelProposer(model=str(tiny_dir("odd-sizes")), num_speculative_tokens=K, engine=config(target))


def test_embedded_draft_ships_with_the_default_model_and_keeps_its_outputs():
    """`deltaserve/default_model/draft/` loads standalone with the default model's tokenizer (same file, same ids)
    and, as the default `draft_model` checkpoint, leaves greedy outputs of the embedded model unchanged."""
    from deltaserve import LLM
    from deltaserve.default_model import DRAFT_PATH, default_model_dir

    names = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "MODEL_CARD.md"}
    assert names <= {p.name for p in DRAFT_PATH.iterdir()}
    assert (DRAFT_PATH / "tokenizer.json").read_bytes() == (default_model_dir() / "tokenizer.json").read_bytes()
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ids = [prompt_ids(4096, 12, seed=s) for s in range(3)]
    plain = LLM(num_blocks=64, num_state_slots=4, max_num_seqs=4)
    spec = LLM(num_blocks=64, num_state_slots=4, max_num_seqs=4,
               speculative_config={"method": "draft_model", "num_speculative_tokens": K})
    assert [o.outputs[0].token_ids for o in spec.generate(ids, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(ids, params)]
    assert spec.engine.get_stats().spec_num_drafts > 0
