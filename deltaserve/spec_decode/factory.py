"""`make_proposer`: the `Proposer` a `SpeculativeConfig` names (the draft model is imported only when asked)."""

from __future__ import annotations

import deltaserve.default_model
from deltaserve.config import EngineConfig, SpeculativeConfig
from deltaserve.config.speculative import BLOCK_DRAFTERS
from deltaserve.spec_decode.dspark import BlockDraftProposer
from deltaserve.spec_decode.ngram import NgramProposer
from deltaserve.spec_decode.proposer import Proposer


def make_proposer(spec: SpeculativeConfig, engine: EngineConfig) -> Proposer:
    """Build the proposer of `spec` for an engine of config `engine`. ValueError (naming the field) when the draft
    model has no checkpoint."""
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None  # resolved by the config
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        model = spec.model or getattr(deltaserve.default_model, "DRAFT_PATH", None)
        if model is None:
            raise ValueError("speculative_config.model is required for method 'draft_model' (this build has no "
                             "embedded draft model)")
        # Imported here: the draft model pulls in the model code, which an n-gram engine does not need.
        from deltaserve.spec_decode.draft_model import (  # type: ignore[import-not-found,unused-ignore]
            DraftModelProposer,
        )

        proposer: Proposer = DraftModelProposer(model=str(model), num_speculative_tokens=spec.num_speculative_tokens,
                                                draft_sample_method=spec.draft_sample_method, engine=engine)
        return proposer
    if spec.method in BLOCK_DRAFTERS:
        return BlockDraftProposer(model=spec.model, num_speculative_tokens=spec.num_speculative_tokens, engine=engine)
    raise ValueError(f"speculative_config.method {spec.method!r} has no proposer")
