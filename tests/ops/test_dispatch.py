"""The op registry (deltaserve.ops.dispatch): choice by availability and support, forcing, the start-up table."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import torch

from deltaserve.ops import dispatch
from deltaserve.ops.norm import ref_rms_norm, rms_norm

OPS_LAYERS_CALL = {
    "kda_gate", "kda_prefill", "kda_decode", "short_conv_prefill", "short_conv_decode", "mla_write_cache",
    "mla_prefill", "mla_decode", "moe_route", "moe_experts", "mxfp4_linear", "attn_res_mix", "rms_norm",
    "gated_rms_norm", "silu_and_mul", "situ_and_mul", "token_counts", "apply_penalties", "apply_token_bitmask",
    "apply_temperature", "apply_top_k_top_p_min_p", "random_sample", "compute_logprobs", "gather_logprobs",
}


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No forcing from the environment; the test backend and any forcing are gone afterwards."""
    monkeypatch.delenv("DELTASERVE_OPS_BACKEND", raising=False)
    dispatch.reset()
    yield
    dispatch.unregister("rms_norm", "fp32_only")
    monkeypatch.delenv("DELTASERVE_OPS_BACKEND", raising=False)
    dispatch.reset()


class Spy:
    """A fast rms_norm that takes fp32 inputs only and counts its calls and availability checks."""

    def __init__(self, available: bool = True) -> None:
        self.calls, self.checks, self.is_available = 0, 0, available

    def fn(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls += 1
        return ref_rms_norm(x, weight, eps)

    def available(self) -> bool:
        self.checks += 1
        return self.is_available

    def backend(self) -> dispatch.Backend:
        return dispatch.Backend("fp32_only", self.fn, available=self.available,
                                supports=lambda x, weight, eps: x.dtype == torch.float32)


def force(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv("DELTASERVE_OPS_BACKEND", spec)
    dispatch.reset()


def test_second_backend_chosen_where_it_supports_the_call() -> None:
    """A registered backend runs the calls it supports (fp32); the reference runs the others (fp64, bf16)."""
    spy = Spy()
    dispatch.register("rms_norm", spy.backend())
    x32, w = torch.randn(3, 8), torch.ones(8)
    assert dispatch.get("rms_norm").select(x32, w, 1e-6) == "fp32_only"
    assert torch.equal(rms_norm(x32, w, 1e-6), ref_rms_norm(x32, w, 1e-6)) and spy.calls == 1
    for dtype in (torch.float64, torch.bfloat16):
        assert dispatch.get("rms_norm").select(x32.to(dtype), w, 1e-6) == "ref"
        rms_norm(x32.to(dtype), w, 1e-6)
    assert spy.calls == 1
    rms_norm(x32, w, 1e-6)
    assert spy.calls == 2 and spy.checks == 1, "availability is asked once, not per call"


def test_unavailable_backend_is_never_chosen() -> None:
    """A backend whose library or device is missing is skipped: its calls go to the reference."""
    spy = Spy(available=False)
    dispatch.register("rms_norm", spy.backend())
    rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert spy.calls == 0 and dispatch.get("rms_norm").resolve() == ("ref",)


def test_forcing_ref_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """DELTASERVE_OPS_BACKEND=ref sends every call to the reference, also where a fast backend supports it."""
    spy = Spy()
    dispatch.register("rms_norm", spy.backend())
    force(monkeypatch, "ref")
    rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert spy.calls == 0
    assert set(dispatch.log_backends().values()) == {("ref",)}


def test_forcing_per_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """`op=backend` entries force one op each; a forced fast backend refuses calls it does not support (no silent
    fallback); other ops keep their own choice."""
    spy = Spy()
    dispatch.register("rms_norm", spy.backend())
    force(monkeypatch, "rms_norm=fp32_only, moe_experts=ref")
    table = dispatch.log_backends()
    assert table["rms_norm"] == ("fp32_only",) and table["moe_experts"] == ("ref",)
    assert table["kda_gate"] == ("ref",)  # not forced, no fast backend: unchanged
    rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert spy.calls == 1
    with pytest.raises(ValueError, match="'fp32_only' for op 'rms_norm'.*does not support"):
        rms_norm(torch.randn(3, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    force(monkeypatch, "rms_norm=ref")
    rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert spy.calls == 1
    force(monkeypatch, "ref,rms_norm=fp32_only")  # ref everywhere but where an op is named
    table = dispatch.log_backends()
    assert table["rms_norm"] == ("fp32_only",) and table["moe_experts"] == ("ref",)


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("rms_norm=fp32_only", RuntimeError, "'fp32_only' for op 'rms_norm', but it is not available"),
        ("rms_norm=flash", ValueError, "'flash' for op 'rms_norm', which has: ref, fp32_only"),
        ("rms_nrom=ref", ValueError, "unknown ops \\['rms_nrom'\\]"),
        ("flash", ValueError, "expected 'ref' or 'op_name=backend'"),
    ],
    ids=["unavailable", "unknown_backend", "unknown_op", "bare_name"],
)
def test_bad_forcing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, spec: str, error: type, match: str) -> None:
    """Forcing a backend that is not available here, or names that do not exist, fails naming the op and backend."""
    dispatch.register("rms_norm", Spy(available=False).backend())
    force(monkeypatch, spec)
    with pytest.raises(error, match=match):
        rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)


def test_log_backends_reports_ref_where_nothing_else_exists(caplog: pytest.LogCaptureFixture) -> None:
    """The start-up table covers every op layers and the sampler call: ref alone where no fast backend is
    registered, the fast backends before ref where they are (on this CPU: the CPU kernels and the packed linear; not
    the Triton kernels, which the interpreter runs only when forced); one log line."""
    with caplog.at_level(logging.INFO, logger="deltaserve.ops.dispatch"):
        table = dispatch.log_backends()
    assert OPS_LAYERS_CALL <= set(table)
    fast = {name: names for name, names in table.items() if names != ("ref",)}
    assert fast == {name: (*(b.name for b in dispatch.get(name).backends if b.available() and not b.forced_only()),
                           "ref") for name in fast}
    from deltaserve.ops.moe import native

    moe = ("sorted", *(("native",) if native.available() else ()), "cpu_dense", "ref")  # native: a C compiler here
    assert table["moe_experts"] == moe
    assert table["rms_norm"] == ("ref",)
    assert len(caplog.records) == 1 and f"moe_experts={'>'.join(moe)}" in caplog.records[0].getMessage()


def test_a_forced_only_backend_runs_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that says `forced_only` (a Triton kernel under the interpreter) is never chosen by itself, but runs
    every call when `DELTASERVE_OPS_BACKEND` names it."""
    spy = Spy()
    dispatch.register("rms_norm", dataclasses.replace(spy.backend(), forced_only=lambda: True))
    force(monkeypatch, "")
    assert dispatch.log_backends()["rms_norm"] == ("ref",)
    rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert spy.calls == 0
    force(monkeypatch, "rms_norm=fp32_only")
    rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert spy.calls == 1


def test_backend_imported_lazily_by_name() -> None:
    """A backend given as "module:attr" is imported when the op resolves, and only if it is available."""
    dispatch.register("rms_norm", dispatch.Backend("fp32_only", "no_such_module_for_test:fn", available=lambda: False))
    rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)  # not imported: unavailable
    dispatch.unregister("rms_norm", "fp32_only")
    dispatch.register("rms_norm", dispatch.Backend("fp32_only", "deltaserve.ops.norm:ref_rms_norm"))
    assert dispatch.get("rms_norm").select(torch.randn(3, 8), torch.ones(8), 1e-6) == "fp32_only"


def test_dispatched_op_keeps_the_reference_interface() -> None:
    """The exported name is documented and introspected like its reference, and a ref-only op calls it directly."""
    assert rms_norm.__doc__ == ref_rms_norm.__doc__ and rms_norm.__name__ == "rms_norm"
    rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert type(rms_norm).__call__ is ref_rms_norm  # no dispatch frame once resolved to ref alone
    with pytest.raises(ValueError, match="already"):
        dispatch.register("moe_experts", dispatch.Backend("sorted", ref_rms_norm))
