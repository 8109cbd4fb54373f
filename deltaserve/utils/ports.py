"""A free TCP port for a rendezvous (process groups, lockstep groups)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the ranks' rendezvous; another process could take it first, as with vLLM's
    choice, in which case rank 0 fails to bind and start-up fails with that error)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
