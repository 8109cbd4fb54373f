"""Speculative decoding: proposers of next tokens, verified by the target model in a multi-token step."""

from deltaserve.spec_decode.proposer import Proposal, Proposer

__all__ = ["Proposal", "Proposer"]
