"""Fixtures of the op tests: the Triton interpreter, for kernels' parity tests on a CPU."""

from __future__ import annotations

import pytest


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Skips unless Triton kernels run in its interpreter here (`tests/conftest.py` sets `TRITON_INTERPRET=1` when
    there is no GPU), and fixes the interpreter for NumPy 2: it turns a loop bound into an int with `int(array)`,
    which NumPy 2 refuses for the one-element arrays the interpreter holds scalars in (every runtime loop bound
    fails: "only 0-dimensional arrays can be converted to Python scalars")."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels are compiled here (a GPU): the interpreter tests run on CPU machines")
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


@pytest.fixture
def fla_interpreter(triton_interpreter, monkeypatch):
    """`triton_interpreter` plus the two fixes fla-core's `chunk_kda` needs there (skips without fla-core):
    - its kernels are autotuned, and the autotuner benchmarks configs through the active driver, which the
      interpreter does not have ("0 active drivers"): the first config is taken, as there is nothing to time;
    - its loops call `.to()` on their loop variables, which compiled Triton makes tensors and the interpreter leaves
      Python ints: inside fla's kernels, `range` yields interpreter tensors instead.
    """
    import builtins

    import numpy as np

    pytest.importorskip("fla", reason="needs fla-core (kernels extra)")
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    run = Autotuner.run

    def first_config_run(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", first_config_run)

    def as_int(value):
        value = getattr(value, "value", value)  # a constexpr
        return int(value.handle.data.reshape(-1)[0]) if isinstance(value, tl.core.tensor) else int(value)

    def tensor_range(*bounds):
        for i in builtins.range(*(as_int(b) for b in bounds)):
            yield tl.core.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

    patch_lang = interpreter._patch_lang

    def patch_fla_range(fn):
        scope = patch_lang(fn)
        if not getattr(fn, "__module__", "").startswith("fla."):
            return scope
        names = fn.__globals__
        had, old = "range" in names, names.get("range")
        names["range"] = tensor_range
        restore = scope.restore

        def undo():
            restore()
            if had:
                names["range"] = old
            else:
                names.pop("range", None)

        scope.restore = undo
        return scope

    monkeypatch.setattr(interpreter, "_patch_lang", patch_fla_range)
