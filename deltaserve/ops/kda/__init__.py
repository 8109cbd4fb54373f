"""KDA ops (model-spec §3): the only names layers call. Today they are the pure-PyTorch reference; a fast backend will
be dispatched from here."""

from deltaserve.ops.kda.ref import kda_decode, kda_gate, kda_prefill

__all__ = ["kda_decode", "kda_gate", "kda_prefill"]
