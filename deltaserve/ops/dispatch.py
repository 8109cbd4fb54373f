"""The op registry: layers (and the sampler) call every op through a dispatched `Op`. Each op has the pure-PyTorch
reference (`ref`: always available, supports every call) and optional fast backends; a call goes to the first backend,
in registration order, that is available here and supports it, else to the reference. `DELTASERVE_OPS_BACKEND`
forces a choice: `ref` for every op, or per op (`kda_prefill=ref,mla_decode=flash`; entries may be combined)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

from deltaserve import envs

P = ParamSpec("P")
R = TypeVar("R")

REF = "ref"
FAMILIES = ("activation", "attn_res", "kda", "linear", "mla", "moe", "mxfp4", "norm", "sampling", "short_conv",
            "vision")
"""The modules of `deltaserve.ops` that define ops; `log_backends` imports them all."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backend:
    """A fast implementation of one op, with the reference's signature and contract."""

    name: str
    fn: Callable[..., Any] | str
    """The implementation, or `"module:attr"`, imported when the op is resolved and only if `available()`."""
    available: Callable[[], bool] = lambda: True
    """Whether it can run in this process (library installed, device present); asked once, when the op resolves."""
    supports: Callable[..., bool] = lambda *args, **kwargs: True
    """Called with the op's arguments before every call: whether it takes them (dtype, shapes, device). Must be cheap
    and must not read the device (a stream sync)."""
    forced_only: Callable[[], bool] = lambda: False
    """Whether it runs only where `DELTASERVE_OPS_BACKEND` names it (asked when the op resolves): a Triton kernel
    under Triton's interpreter is correct but far too slow to be chosen by itself."""


_Chain = tuple[tuple[str, Callable[..., Any], Callable[..., bool]], ...]


class Op:
    """A dispatched op; calling it runs the chosen backend. The first call resolves the op (availability, forcing)
    and installs the resulting call as `__call__` of the op's own class (Python looks special methods up on the
    type): a ref-only op then calls the reference directly, with no Python frame of its own."""

    def __init__(self, name: str, ref: Callable[..., Any]) -> None:
        if type(self) is Op:
            raise TypeError("ops are made with dispatch.op(), which gives each its own class")
        self.name, self.ref = name, ref
        self.backends: list[Backend] = []
        """Fast backends, tried in this order."""
        self.chain: _Chain | None = None
        """(name, fn, supports) of the backends calls try before the reference; None until resolved."""
        self.__wrapped__, self.__name__, self.__module__ = ref, name, ref.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # replaced per op by `resolve`
        self.resolve()
        return self(*args, **kwargs)

    def unresolve(self) -> None:
        """Forget the choice: the next call resolves again (after a registration or a change of forcing)."""
        self.chain = None
        type(self).__call__ = Op.__call__  # type: ignore[method-assign]

    def resolve(self) -> tuple[str, ...]:
        """Choose the backends this op tries; returns their names in order (`ref` last unless a fast one is forced)."""
        forced_ops = forcing()
        forced = forced_ops.get(self.name, forced_ops.get("*"))
        if forced is None:
            chain = tuple((b.name, _load(b.fn), b.supports) for b in self.backends
                          if b.available() and not b.forced_only())
        elif forced == REF:
            chain = ()
        else:
            b = self._forced(forced)
            chain = ((b.name, _load(b.fn), _required(self.name, b)),)
        ref = self.ref
        if not chain:
            call: Callable[..., Any] = ref
        else:
            def call(*args: Any, **kwargs: Any) -> Any:
                for _, fn, supports in chain:
                    if supports(*args, **kwargs):
                        return fn(*args, **kwargs)
                return ref(*args, **kwargs)
        self.chain = chain
        type(self).__call__ = staticmethod(call)  # type: ignore[method-assign]
        names = tuple(name for name, _, _ in chain)
        return names if forced not in (None, REF) else (*names, REF)

    def select(self, *args: Any, **kwargs: Any) -> str:
        """The name of the backend a call with these arguments runs (for tests and diagnostics)."""
        if self.chain is None:
            self.resolve()
        return next((name for name, _, supports in self.chain or () if supports(*args, **kwargs)), REF)

    def _forced(self, name: str) -> Backend:
        b = next((b for b in self.backends if b.name == name), None)
        if b is None:
            known = ", ".join([REF, *(b.name for b in self.backends)])
            raise ValueError(f"DELTASERVE_OPS_BACKEND forces backend {name!r} for op {self.name!r}, which has: {known}")
        if not b.available():
            raise RuntimeError(f"DELTASERVE_OPS_BACKEND forces backend {name!r} for op {self.name!r}, but it is not "
                               "available here (library not installed or no suitable device)")
        return b


_OPS: dict[str, Op] = {}
_forcing: dict[str, str] | None = None


def op(name: str, ref: Callable[P, R]) -> Callable[P, R]:
    """Define the op `name` with its reference implementation; returns the dispatched callable (typed as `ref`)."""
    if name in _OPS:
        raise ValueError(f"op {name!r} is already defined")
    cls = type(f"Op[{name}]", (Op,), {"__doc__": ref.__doc__})
    _OPS[name] = instance = cls(name, ref)
    return cast(Callable[P, R], instance)


def get(name: str) -> Op:
    """The dispatched op `name` (its family must be imported)."""
    return _OPS[name]


def register(op_name: str, backend: Backend) -> None:
    """Add a fast backend to an op, after those already registered (so: fastest first)."""
    target = _OPS[op_name]
    if backend.name == REF or any(b.name == backend.name for b in target.backends):
        raise ValueError(f"op {op_name!r} already has a backend {backend.name!r}")
    target.backends.append(backend)
    target.unresolve()


def unregister(op_name: str, backend_name: str) -> None:
    """Remove a fast backend from an op (tests)."""
    target = _OPS[op_name]
    target.backends[:] = [b for b in target.backends if b.name != backend_name]
    target.unresolve()


def reset() -> None:
    """Re-read `DELTASERVE_OPS_BACKEND` and re-resolve every op on its next call."""
    global _forcing
    _forcing = None
    for o in _OPS.values():
        o.unresolve()


def parse_forcing(spec: str) -> dict[str, str]:
    """`"ref"` -> `{"*": "ref"}`; `"kda_prefill=ref,mla_decode=flash"` -> per op; `""` -> `{}`."""
    forced: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        op_name, sep, backend = (s.strip() for s in entry.partition("="))
        if not sep and op_name == REF:
            forced["*"] = REF
        elif not sep or not op_name or not backend:
            raise ValueError(f"DELTASERVE_OPS_BACKEND entry {entry!r}: expected 'ref' or 'op_name=backend'")
        else:
            forced[op_name] = backend
    return forced


def forcing() -> dict[str, str]:
    """The parsed `DELTASERVE_OPS_BACKEND` (read once, until `reset`); an op name it does not define is an error."""
    global _forcing
    if _forcing is None:
        forced = parse_forcing(envs.ops_backend())
        if set(forced) - {"*"}:
            _import_families()
            unknown = sorted(set(forced) - {"*"} - set(_OPS))
            if unknown:
                raise ValueError(f"DELTASERVE_OPS_BACKEND names unknown ops {unknown}; ops: {sorted(_OPS)}")
        _forcing = forced
    return _forcing


def log_backends(log: logging.Logger = logger) -> dict[str, tuple[str, ...]]:
    """Resolve every op and log the choice once (one INFO line). Call at engine start-up.

    Returns:
        op name -> the backends its calls try, in order: `("ref",)` where no fast backend is available (or `ref` is
        forced), `("sorted", "ref")` where one is, `("flash",)` where a fast backend is forced.
    """
    _import_families()
    table = {name: o.resolve() for name, o in sorted(_OPS.items())}
    fast = [f"{name}={'>'.join(names)}" for name, names in table.items() if names != (REF,)]
    spec = envs.ops_backend()
    log.info("op backends%s: %s; %d other ops: ref", f" (DELTASERVE_OPS_BACKEND={spec})" if spec else "",
             ", ".join(fast) or "none but ref", len(table) - len(fast))
    return table


def _import_families() -> None:
    for family in FAMILIES:
        importlib.import_module(f"deltaserve.ops.{family}")


def _load(fn: Callable[..., Any] | str) -> Callable[..., Any]:
    if callable(fn):
        return fn
    module, _, attr = fn.partition(":")
    return cast(Callable[..., Any], getattr(importlib.import_module(module), attr))


def _required(op_name: str, b: Backend) -> Callable[..., bool]:
    """`b.supports`, raising instead of falling back to the reference: a forced backend must take every call."""

    def supports(*args: Any, **kwargs: Any) -> bool:
        if not b.supports(*args, **kwargs):
            raise ValueError(f"DELTASERVE_OPS_BACKEND forces backend {b.name!r} for op {op_name!r}, "
                             "which does not support this call (dtype, shape or device)")
        return True

    return supports
