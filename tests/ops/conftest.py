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
