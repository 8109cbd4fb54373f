"""Speculative decoding: proposers of next tokens, verified by the target model in a multi-token step."""

from deltaserve.spec_decode.factory import make_proposer
from deltaserve.spec_decode.metrics import SpecDecodeStats
from deltaserve.spec_decode.ngram import NgramProposer
from deltaserve.spec_decode.proposer import Proposal, Proposer

__all__ = ["NgramProposer", "Proposal", "Proposer", "SpecDecodeStats", "make_proposer"]
