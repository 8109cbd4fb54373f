"""The block drafter (speculative method dspark, issue 22): its network, its features, and the engine with it.

The engine tests use a drafter fitted in seconds to the tiny checkpoint's own greedy outputs (`fitted_drafter`), so
that drafts are often right and the runs cover accepted runs, partial acceptances and rejections; greedy outputs must
equal plain decoding's under mixed batches, chunked prefill, a prefix hit and preemption (the harness of
test_spec_identity.py), with adaptive verification on and off.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from deltaserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.models.dspark import DSparkConfig, DSparkDrafter, load_drafter, resolve_drafter_path
from deltaserve.models.loader import load_model
from deltaserve.runner.drafter_graphs import DrafterGraphs
from deltaserve.runner.feature_taps import FeatureTaps
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec_decode.adaptive import AdaptiveVerifier
from deltaserve.spec_decode.cost_model import StepCostModel
from deltaserve.spec_decode.dspark import BlockDraftProposer
from deltaserve.spec_decode.dspark_training import (
    acceptance_length,
    fit,
    sequence_features,
)
from tests.helpers import prompt_ids
from tests.spec_decode.test_spec_identity import (
    Counting,
    assert_all_free,
    assert_features_hit,
    engine_config,
    plain_run,
    requests,
    run,
)

K = 5
TAPS = (1, 7)
FIT_STEPS = 120


def small_config(vocab: int, hidden: int, **kw) -> DSparkConfig:
    return DSparkConfig(vocab_size=vocab, hidden_size=hidden, tap_layers=TAPS, num_layers=1, num_heads=4,
                        intermediate_size=128, block_size=K, context_window=8, **kw)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tiny_dir) -> str:
    return str(tiny_dir("base"))


@pytest.fixture(scope="module")
def fitted_drafter(base, tmp_path_factory) -> str:
    """A drafter for the base checkpoint fitted (the objective of scripts/train_dspark.py, a few seconds) to the
    plain greedy run of the identity batch: its drafts are mostly right where its context window is as in training,
    and wrong elsewhere (windows restarted by chunking, a prefix hit or a recompute), so the runs cover accepted
    runs, partial acceptances and rejections."""
    torch.manual_seed(0)
    plain = plain_run(base, "float32")
    target = load_model(base)
    cfg = ModelConfig.from_pretrained(base)
    dcfg = small_config(cfg.vocab_size, cfg.hidden_size)
    seqs = sequence_features(target, [(prompt + plain.tokens[rid], len(prompt))
                                      for rid, (prompt, _) in requests(base).items()], TAPS, dcfg.context_window)
    drafter = DSparkDrafter(dcfg).init_for_training()
    correct, _ = fit(drafter, seqs, target.embed_tokens.float(), target.lm_head.float(), FIT_STEPS)
    assert acceptance_length(correct) > 2.0, "the fit failed: the engine runs would not cover accepted drafts"
    out = tmp_path_factory.mktemp("drafter")
    drafter.save(out)
    return str(out)


# -- the network ------------------------------------------------------------------------------------------------


def test_block_rows_see_the_context_and_each_other():
    """Non-causal block: every drafted row depends on the context and on the known first token; padding rows of the
    context change nothing."""
    torch.manual_seed(0)
    cfg = small_config(50, 32)
    drafter = DSparkDrafter(cfg).init_for_training().eval()
    feats = torch.randn(2, cfg.context_window, cfg.feature_size)
    valid = torch.ones(2, cfg.context_window, dtype=torch.bool)
    valid[1, :3] = False
    first = torch.randn(2, 32)
    out = drafter(feats, valid, first)
    assert out.shape == (2, K, 32)
    changed_pad = feats.clone()
    changed_pad[1, :3] += 5.0
    assert torch.allclose(drafter(changed_pad, valid, first)[1], out[1], atol=1e-6)
    changed_ctx = feats.clone()
    changed_ctx[0, -1] += 1.0
    assert (drafter(changed_ctx, valid, first)[0] - out[0]).abs().amax(dim=-1).min() > 1e-4
    other_first = first.clone()
    other_first[0] += 1.0
    assert (drafter(feats, valid, other_first)[0] - out[0]).abs().amax(dim=-1).min() > 1e-4
    # Fewer drafts: the same rows attend to fewer mask rows, so they differ (non-causal), but the shape follows.
    assert drafter(feats, valid, first, num_drafts=2).shape == (2, 2, 32)


def test_checkpoint_round_trip_and_errors(tmp_path):
    torch.manual_seed(0)
    drafter = DSparkDrafter(small_config(50, 32)).init_for_training()
    drafter.save(tmp_path / "d")
    loaded = load_drafter(tmp_path / "d")
    assert loaded.config == drafter.config
    for name, t in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="num_heads"):
        small_config(50, 30)
    with pytest.raises(ValueError, match="tap_layers"):
        DSparkConfig(vocab_size=5, hidden_size=8, tap_layers=())
    (tmp_path / "d" / "config.json").write_text('{"architectures": ["KimiLinearForCausalLM"]}')
    with pytest.raises(ValueError, match="not a DSparkDrafter"):
        load_drafter(tmp_path / "d")
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        resolve_drafter_path(None, str(tmp_path))


def test_feature_taps_are_the_tapped_layer_outputs(base):
    model = load_model(base)
    taps = FeatureTaps(model, TAPS)
    seen = {}
    hooks = [model.decoder_layers[i].register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o.clone()))
             for i in TAPS]
    ids = prompt_ids(ModelConfig.from_pretrained(base).vocab_size, 9, seed=1)
    seq = sequence_features(model, [(ids, 4)], TAPS, window=2)[0]
    for h in hooks:
        h.remove()
    expected = torch.cat([seen[i] for i in TAPS], dim=-1)[2:]
    assert seq.first_anchor == 2 and seq.token_ids.tolist() == ids[2:]
    assert torch.allclose(seq.features.float(), expected.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="out of range"):
        FeatureTaps(model, (99,))
    taps.remove()


# -- the engine -------------------------------------------------------------------------------------------------


class CountingDrafts(Counting):
    """`Counting` for a proposer whose drafts come from the workers."""

    def receive(self, drafts) -> None:  # noqa: ANN001
        self.inner.receive(drafts)


def _replace_spec(cfg: EngineConfig, spec: SpeculativeConfig) -> EngineConfig:
    return dataclasses.replace(cfg, speculative_config=spec)


@pytest.mark.parametrize("adaptive", [False, True], ids=["verify_all", "adaptive"])
def test_block_drafter_gives_plain_greedy_output(base, fitted_drafter, adaptive):
    plain = plain_run(base, "float32")
    config = _replace_spec(engine_config(base), SpeculativeConfig(
        method="dspark", num_speculative_tokens=K, model=fitted_drafter, enable_adaptive_verification=adaptive))
    # Adaptive: fixed cost models (no step-time corrections), dearer and dearer until one cuts some offered positions
    # and verifies others: where that happens depends on the fitted drafter's confidences (its training's rounding).
    partial = False
    for verify_factor in (0.25, 0.5, 1.0, 2.0) if adaptive else (None,):
        counting = CountingDrafts(BlockDraftProposer(model=fitted_drafter, num_speculative_tokens=K, engine=config))
        core = EngineCore(config, proposer=counting)
        if verify_factor is not None:
            assert core.proposer_hook is not None and core.proposer_hook.verifier is not None
            core.proposer_hook.verifier = AdaptiveVerifier(synthetic_costs(verify_factor), K,
                                                           correct_with_step_times=False)
        spec = run(core, requests(base))
        assert spec.tokens == plain.tokens
        assert counting.proposed > 0
        assert_features_hit(core)
        assert_all_free(core)
        stats = core.proposer_hook.stats
        verifier = core.proposer_hook.verifier
        if verifier is None:
            assert spec.multi_token_outputs > 0, "no draft was ever accepted"
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "no draft was ever rejected (or accepted)"
            partial = True
        else:
            assert verifier.stats.num_steps > 0 and core.get_stats().spec_adaptive_steps == verifier.stats.num_steps
            partial = 0 < verifier.stats.num_verified_positions < verifier.stats.num_offered_positions
            if partial:  # adaptive verification may offer only drafts that are then all accepted
                assert spec.multi_token_outputs > 0 and stats.num_accepted_tokens > 0
        core.shutdown()
        if partial:
            break
    assert partial, "no cost model gave partial decisions: every offered position verified, or none"


def test_proposer_offers_only_current_drafts(base, fitted_drafter):
    """A draft applies only while the request has exactly the tokens it continues, cut to the room left."""
    from deltaserve.request import Request
    from deltaserve.scheduler.output import BlockDraft

    config = _replace_spec(engine_config(base), SpeculativeConfig(method="dspark", num_speculative_tokens=K,
                                                                  model=fitted_drafter))
    proposer = BlockDraftProposer(model=fitted_drafter, num_speculative_tokens=K, engine=config)
    req = Request(request_id="a", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4),
                  stop_token_ids=frozenset(), arrival_index=0, max_total_tokens=100)
    req.output_token_ids.append(7)
    proposer.receive({"a": BlockDraft((5, 6, 7, 8, 9), (0.9,) * 5, num_tokens=4)})
    got = proposer.propose([req])["a"]
    assert got.token_ids == [5, 6] and got.confidences == (0.9, 0.9)  # 3 more tokens at most: 2 drafts + 1
    req.output_token_ids.append(5)
    assert proposer.propose([req]) == {}
    assert proposer.memory_bytes > 0
    with pytest.raises(ValueError, match="exceeds the drafter's block_size"):
        BlockDraftProposer(model=fitted_drafter, num_speculative_tokens=K + 1, engine=config)


def test_embedded_model_loads_its_drafter_by_default():
    from deltaserve.default_model import DSPARK_PATH, default_model_dir

    assert resolve_drafter_path(None, default_model_dir()) == DSPARK_PATH
    assert (Path(DSPARK_PATH) / "MODEL_CARD.md").is_file()


def synthetic_costs(verify_factor: float) -> StepCostModel:
    """Step seconds 1 ms per sequence-step plus `verify_factor` ms per verified draft token; drafting free."""
    batch, qlens = (1, 8), (1, K + 1)
    seconds = tuple(tuple(tuple(1e-3 * b + verify_factor * 1e-3 * b * (q - 1) for q in qlens) for b in batch)
                    for _ in (0, 1))
    return StepCostModel(batch_sizes=batch, query_lens=qlens, context_lens=(0, 4096), seconds=seconds,
                         draft_seconds=(0.0, 0.0))


@pytest.mark.parametrize("verify_factor, verifies", [(0.01, True), (50.0, False)], ids=["cheap", "dear"])
def test_adaptive_decisions_change_no_output(base, fitted_drafter, verify_factor, verifies):
    """The same batch under a verifier that finds verification nearly free (verifies drafts) and one that finds it
    dearer than any gain (verifies none, then turns drafting off): outputs equal plain decoding either way."""
    plain = plain_run(base, "float32")
    config = _replace_spec(engine_config(base), SpeculativeConfig(method="dspark", num_speculative_tokens=K,
                                                                  model=fitted_drafter))
    core = EngineCore(config)
    assert core.proposer_hook is not None and core.proposer_hook.verifier is not None
    core.proposer_hook.verifier = AdaptiveVerifier(synthetic_costs(verify_factor), K, correct_with_step_times=False)
    spec = run(core, requests(base))
    assert spec.tokens == plain.tokens
    stats = core.get_stats()
    assert stats.spec_adaptive_steps > 0
    if verifies:
        assert stats.spec_adaptive_verified_positions > 0 and stats.spec_num_accepted_tokens > 0
        assert spec.multi_token_outputs > 0
    else:
        assert stats.spec_adaptive_verified_positions == 0 and stats.spec_num_draft_tokens == 0
        assert stats.spec_adaptive_draft_off_steps > 0
    assert_all_free(core)
    core.shutdown()


class ScriptedDrafting(AdaptiveVerifier):
    """Verifies no draft (so every run decodes as plain decoding does, step for step) and drafts on the steps
    `drafts_on(step)` allows (for every request; steps counted from 1, by `drafts_for` calls)."""

    def __init__(self, drafts_on) -> None:  # noqa: ANN001
        super().__init__(synthetic_costs(1.0), K, correct_with_step_times=False)
        self.drafts_on, self.step = drafts_on, 0

    def choose(self, confidences, context_lens, **_kw) -> list[int]:  # noqa: ANN001
        return [0] * len(confidences)

    def drafts_for(self, num_seqs: int, context_len: int, **_kw) -> int:
        self.step += 1
        return num_seqs if self.drafts_on(self.step) else 0


class RecordingDrafts(CountingDrafts):
    """Keeps every step's drafts, by the step they were made after."""

    def __init__(self, inner, verifier: ScriptedDrafting) -> None:  # noqa: ANN001
        super().__init__(inner)
        self.verifier, self.drafts = verifier, {}

    def receive(self, drafts) -> None:  # noqa: ANN001
        self.drafts[self.verifier.step] = dict(drafts)
        super().receive(drafts)


def _scripted_run(base: str, drafter: str, drafts_on) -> dict[int, dict]:  # noqa: ANN001
    config = _replace_spec(engine_config(base), SpeculativeConfig(method="dspark", num_speculative_tokens=K,
                                                                  model=drafter))
    verifier = ScriptedDrafting(drafts_on)
    recording = RecordingDrafts(BlockDraftProposer(model=drafter, num_speculative_tokens=K, engine=config), verifier)
    core = EngineCore(config, proposer=recording)
    assert core.proposer_hook is not None
    core.proposer_hook.verifier = verifier
    assert run(core, requests(base)).tokens == plain_run(base, "float32").tokens
    assert_features_hit(core)
    assert_all_free(core)
    core.shutdown()
    return recording.drafts


def test_windows_folded_after_steps_without_drafting_give_the_same_drafts(base, fitted_drafter):
    """Steps that do not draft only record their features, folded into the windows when a step drafts again: the
    drafts after a gap shorter than the window (mixed batch, chunked prefill, prefix hit, preemption) equal those of
    a run that drafts every step; after longer gaps (older records dropped) drafting still runs, outputs unchanged."""
    window = load_drafter(fitted_drafter).config.context_window
    every = _scripted_run(base, fitted_drafter, lambda step: True)
    gapped = _scripted_run(base, fitted_drafter, lambda step: step % 4 == 0)
    assert len(every) > 8 and len(gapped) >= 4
    for step, drafts in gapped.items():
        assert drafts == every[step], f"step {step}: drafts differ from a run that drafted every step"
    long_gaps = _scripted_run(base, fitted_drafter, lambda step: step % (window + 3) == 0)
    assert long_gaps and all(long_gaps.values())


def count_drafter_batches(core: EngineCore) -> list[int]:
    """The batch size of every drafter forward `core`'s worker runs from now on (appended as they run)."""
    drafting = core.executor.worker.runner.drafting  # type: ignore[attr-defined]
    batches: list[int] = []

    def counted(features, *args):  # noqa: ANN001, ANN002, ANN202
        batches.append(features.shape[0])
        return drafting.drafter(features, *args)

    drafting.forward = counted
    return batches


def test_disable_by_batch_size_stops_the_drafter_forward_too(base, fitted_drafter):
    """With `disable_by_batch_size`, steps at that load propose nothing, and the workers do not draft for them either
    (drafts nobody would offer): the drafter runs only once fewer requests run; outputs unchanged."""
    config = _replace_spec(engine_config(base), SpeculativeConfig(
        method="dspark", num_speculative_tokens=K, model=fitted_drafter, enable_adaptive_verification=False,
        disable_by_batch_size=2))
    core = EngineCore(config)
    batches = count_drafter_batches(core)
    vocab = ModelConfig.from_pretrained(base).vocab_size
    for rid, n in (("short", 3), ("long", 14)):
        core.add_request(rid, prompt_ids(vocab, 6, seed=len(rid)), SamplingParams(temperature=0.0, max_tokens=n,
                                                                                   ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    assert batches and set(batches) == {1}, batches
    core.shutdown()


class AlwaysProbing(AdaptiveVerifier):
    """Drafts for one request per step (a probe, every step); verifies every draft offered."""

    def __init__(self) -> None:
        super().__init__(synthetic_costs(0.01), K, correct_with_step_times=False)

    def choose(self, confidences, context_lens, **_kw) -> list[int]:  # noqa: ANN001
        return [len(c) for c in confidences]

    def drafts_for(self, num_seqs: int, context_len: int, **_kw) -> int:
        return 1


def test_probing_steps_draft_for_one_request_in_turn(base, fitted_drafter):
    """A probe drafts for one request (a batch-1 drafter forward), each request in turn; outputs are plain
    decoding's (mixed batch, chunked prefill, prefix hit, preemption)."""
    config = _replace_spec(engine_config(base), SpeculativeConfig(method="dspark", num_speculative_tokens=K,
                                                                  model=fitted_drafter))
    counting = CountingDrafts(BlockDraftProposer(model=fitted_drafter, num_speculative_tokens=K, engine=config))
    received: list[set[str]] = []
    inner_receive = counting.receive
    counting.receive = lambda drafts: (received.append(set(drafts)), inner_receive(drafts))  # type: ignore[method-assign]
    core = EngineCore(config, proposer=counting)
    assert core.proposer_hook is not None
    core.proposer_hook.verifier = AlwaysProbing()
    batches = count_drafter_batches(core)
    assert run(core, requests(base)).tokens == plain_run(base, "float32").tokens
    assert batches and set(batches) == {1}
    assert all(len(ids) == 1 for ids in received) and len(set().union(*received)) >= 3
    assert counting.proposed > 0 and core.proposer_hook.stats.num_accepted_tokens > 0
    assert_features_hit(core)
    assert_all_free(core)
    core.shutdown()


# -- compiled drafter graphs -------------------------------------------------------------------------------------


def test_requests_run_while_drafter_graphs_compile_then_use_them(base, fitted_drafter, tmp_path):
    """The compile of the drafter's graphs runs beside the engine: a whole batch completes while it is held (the
    compile waits on an event the test sets only afterwards), then, once the graphs are in, steps draft through them;
    greedy outputs equal plain decoding's before and after."""
    plain = plain_run(base, "float32")
    config = _replace_spec(engine_config(base), SpeculativeConfig(
        method="dspark", num_speculative_tokens=K, model=fitted_drafter, enable_adaptive_verification=False))
    core = EngineCore(config)
    drafting = core.executor.worker.runner.drafting  # type: ignore[attr-defined]
    release, calls = threading.Event(), Counter()

    def held_compile(_drafter, _batch: int, path: Path) -> None:
        if not release.wait(timeout=120):
            raise TimeoutError("the test never released the compile")
        path.write_bytes(b"graph")

    def load(_path: Path):
        def graph(features, valid, first_embeds):  # the eager drafter, counted: a stand-in for the compiled graph
            calls[features.shape[0]] += 1
            return drafting.drafter(features, valid, first_embeds)
        return graph

    graphs = DrafterGraphs(drafting.drafter, cache_dir=tmp_path, compile_fn=held_compile, load_fn=load)
    drafting.forward = graphs
    assert run(core, requests(base)).tokens == plain.tokens  # every step while the compile is held
    jobs = [job for b in (1, 2, 4, 8) if (job := graphs.job(b)) is not None]
    assert jobs and not calls and not any(job.done() for job in jobs)
    release.set()
    for job in jobs:
        job.result(timeout=120)
    again = run(core, requests(base))
    assert again.tokens == plain.tokens and sum(calls.values()) > 0 and graphs.enabled
    assert_all_free(core)
    core.shutdown()
