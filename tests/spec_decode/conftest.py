"""Fixtures of the speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: every float (and so every sampled token) is the same whatever the machine's core count,
    and on a loaded two-core machine the runs take seconds, not minutes (OpenMP threads waiting for each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
