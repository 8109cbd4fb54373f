"""The vision tests run torch on one thread (the machine's cores are shared; the tiny towers gain nothing more)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread) -> None:  # noqa: ANN001 - the shared fixture (tests/conftest.py)
    """Every vision test under `one_thread`."""
