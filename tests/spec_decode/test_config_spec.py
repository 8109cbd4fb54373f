"""`SpeculativeConfig` (vLLM's `--speculative-config` keys): defaults, one-line errors naming each bad field, and
`make_proposer`; `SpecDecodeStats`' counters."""

from __future__ import annotations

import json

import pytest

import deltaserve.default_model
from deltaserve.config import EngineConfig, SpeculativeConfig
from deltaserve.spec_decode.factory import make_proposer
from deltaserve.spec_decode.metrics import SpecDecodeStats
from deltaserve.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_ngram_bounds_follow_vllm_defaults():
    """Neither bound: both 5; one bound: the other equals it (vLLM's rule)."""
    assert _bounds(SpeculativeConfig.from_json(NGRAM)) == (5, 5)
    assert _bounds(SpeculativeConfig.from_json({**NGRAM, "prompt_lookup_max": 4})) == (4, 4)
    assert _bounds(SpeculativeConfig.from_json({**NGRAM, "prompt_lookup_min": 2})) == (2, 2)
    assert _bounds(SpeculativeConfig.from_json({**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 3})) == (1, 3)


def _bounds(c: SpeculativeConfig) -> tuple[int | None, int | None]:
    return c.prompt_lookup_min, c.prompt_lookup_max


def test_from_json_text_dict_and_config_agree():
    text = json.dumps({**NGRAM, "prompt_lookup_max": 4})
    parsed = SpeculativeConfig.from_json(text)
    assert parsed == SpeculativeConfig.from_json(json.loads(text)) == SpeculativeConfig.from_json(parsed)
    assert parsed.method == "ngram" and parsed.num_speculative_tokens == 3 and parsed.model is None


def test_draft_model_defaults():
    c = SpeculativeConfig.from_json({"method": "draft_model", "num_speculative_tokens": 4})
    assert (c.model, c.draft_sample_method, c.prompt_lookup_min) == (None, "probabilistic", None)
    c = SpeculativeConfig.from_json({"method": "draft_model", "num_speculative_tokens": 1, "model": "/ckpt",
                                     "draft_sample_method": "greedy"})
    assert (c.model, c.draft_sample_method) == ("/ckpt", "greedy")


def test_dspark_defaults():
    c = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 7})
    assert (c.model, c.draft_sample_method, c.rejection_sample_method, c.enable_adaptive_verification) == (
        None, "probabilistic", "standard", True)
    c = SpeculativeConfig.from_json('{"method": "dflash", "num_speculative_tokens": 3, '
                                    '"rejection_sample_method": "block", "enable_adaptive_verification": false}')
    assert (c.method, c.rejection_sample_method, c.enable_adaptive_verification) == ("dflash", "block", False)


@pytest.mark.parametrize("value, message", [
    ("{", "speculative_config is not valid JSON"),
    ("[1]", "speculative_config must be a JSON object"),
    ({**NGRAM, "speculative_token_tree": "x"}, "speculative_config has unknown field(s) 'speculative_token_tree'"),
    ({"num_speculative_tokens": 3}, "speculative_config.method is required"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
    ({**NGRAM, "method": "draft"},
     "speculative_config.method must be one of 'ngram', 'draft_model', 'dspark', 'dflash', got 'draft'"),
    ({**NGRAM, "method": 1}, "speculative_config.method must be a string, got 1"),
    ({**NGRAM, "num_speculative_tokens": 0},
     "speculative_config.num_speculative_tokens must be an integer in 1..16, got 0"),
    ({**NGRAM, "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens must be an integer in 1..16"),
    ({**NGRAM, "num_speculative_tokens": 2.0}, "speculative_config.num_speculative_tokens must be an integer"),
    ({**NGRAM, "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens must be an integer"),
    ({**NGRAM, "num_speculative_tokens": "3"}, "speculative_config.num_speculative_tokens must be an integer"),
    ({**NGRAM, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min must be an integer in 1..64, got 0"),
    ({**NGRAM, "prompt_lookup_max": 65}, "speculative_config.prompt_lookup_max must be an integer in 1..64"),
    ({**NGRAM, "prompt_lookup_max": "5"}, "speculative_config.prompt_lookup_max must be an integer"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({**NGRAM, "model": "/ckpt"}, "speculative_config.model does not apply to method 'ngram'"),
    ({**NGRAM, "draft_sample_method": "greedy"},
     "speculative_config.draft_sample_method does not apply to method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_max does not apply to method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "speculative_config.model must be"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3}, "speculative_config.model must be a string"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "draft_sample_method": "random"},
     "speculative_config.draft_sample_method must be 'greedy' or 'probabilistic', got 'random'"),
    ({"method": "dspark", "num_speculative_tokens": 7, "rejection_sample_method": "joint"},
     "speculative_config.rejection_sample_method must be 'standard' or 'block', got 'joint'"),
    ({**NGRAM, "rejection_sample_method": "block"},
     "speculative_config.rejection_sample_method does not apply to method 'ngram'"),
    ({"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": "yes"},
     "speculative_config.enable_adaptive_verification must be true or false, got 'yes'"),
])
def test_bad_configs_are_one_line_errors_naming_the_field(value, message):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_json(value)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_constructor_checks_like_from_json():
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in 1\.\.16, got 0"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)


def test_engine_config_takes_only_a_speculative_config():
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert EngineConfig(model="m", speculative_config=spec).speculative_config is spec
    assert EngineConfig(model="m").speculative_config is None
    with pytest.raises(ValueError, match="speculative_config must be SpeculativeConfig or None"):
        EngineConfig(model="m", speculative_config=NGRAM)  # type: ignore[arg-type]


def test_make_proposer_ngram():
    spec = SpeculativeConfig.from_json({**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    proposer = make_proposer(spec, EngineConfig(model="m", speculative_config=spec))
    assert isinstance(proposer, NgramProposer)
    assert (proposer.num_speculative_tokens, proposer.min_n, proposer.max_n, proposer.memory_bytes) == (3, 2, 4, 0)


def test_draft_model_without_a_checkpoint_is_a_config_error(monkeypatch):
    """No `model` and no embedded draft (`default_model.DRAFT_PATH`): the error names the field."""
    monkeypatch.delattr(deltaserve.default_model, "DRAFT_PATH", raising=False)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_config.model is required for method 'draft_model'"):
        make_proposer(spec, EngineConfig(model="m", speculative_config=spec))


def test_spec_decode_stats():
    stats = SpecDecodeStats()
    assert stats.mean_acceptance_length == 1.0 and stats.acceptance_rate == 0.0
    stats.observe(3, 2)
    stats.observe(3, 0)
    stats.observe(0, 0)  # nothing proposed: not a draft
    stats.observe(4, 4)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 10, 6)
    assert stats.accepted_per_pos == [2, 2, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 3)
    assert stats.acceptance_rate == pytest.approx(0.6)
    with pytest.raises(ValueError):
        stats.observe(2, 3)


def test_disable_by_batch_size_is_checked_and_stops_proposals(tiny_dir):
    """vLLM's disable_by_batch_size: a step with that many running requests proposes nothing (outputs unchanged)."""
    with pytest.raises(ValueError, match=r"^speculative_config.disable_by_batch_size must be an integer"):
        SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0})
    from deltaserve.engine.engine_core import EngineCore
    from deltaserve.sampling_params import SamplingParams
    from deltaserve.spec_decode import Proposal

    class Always:  # proposes two tokens for every request, whatever the context
        num_speculative_tokens, memory_bytes = 2, 0
        widest = 0

        def propose(self, requests):
            self.widest = max(self.widest, len(requests))
            return {r.request_id: Proposal([1, 2]) for r in requests}

        def forget(self, request_id):
            pass

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    widest = {}
    for limit in (2, 3):  # two requests run together: limit 2 disables speculation then, 3 does not
        spec = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2,
                                            "disable_by_batch_size": limit})
        proposer = Always()
        core = EngineCore(EngineConfig(model=str(tiny_dir("base")), speculative_config=spec), proposer=proposer)
        for rid in ("a", "b"):
            core.add_request(rid, [5, 6, 7, 8] * 6, params)
        while core.has_unfinished_requests():
            core.step()
        widest[limit] = proposer.widest
        assert core.get_stats().spec_num_drafts > 0
    assert widest == {2: 1, 3: 2}  # asked only once a single request ran
