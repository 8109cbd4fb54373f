"""Receive buffers that become the `bytes` a fetch returns without a copy.

`TransferClient.fetch` returns `bytes`, which Python cannot write into; reading into a bytearray and converting
costs one more pass over the payload, which on these machines halves a fetch's throughput (fresh pages are faulted
in twice: measured 0.55 GB/s against 1.3 GB/s for a 256 MiB TCP read). So the client allocates a fresh `bytes`
object (calloc'd: its pages are mapped lazily) and lets the socket, NIXL or Mooncake write into its storage before
anyone else sees it. This is sound for an object nobody else references: it is new (sizes of 2 bytes and more are
never shared singletons), its hash is not computed until someone asks, and it is handed out only once written.
"""

from __future__ import annotations

import ctypes

import numpy as np


class ReceiveBuffer:
    """Storage a transfer writes into (`view`, or `address` for the transfer libraries), then `take`n as bytes."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        # b"" and one-byte objects are shared singletons: never write into those; a small bytearray copies cheaply.
        self._storage: bytes | bytearray = bytearray(nbytes) if nbytes < 2 else bytes(nbytes)
        self.address = int(np.frombuffer(self._storage, dtype=np.uint8).ctypes.data) if nbytes else 0
        if isinstance(self._storage, bytearray):
            self.view = memoryview(self._storage)
        else:
            self.view = memoryview((ctypes.c_char * nbytes).from_address(self.address)).cast("B")

    def take(self) -> bytes:
        """The payload (call once, after the last write; drop the view and address then)."""
        self.view.release()
        return bytes(self._storage) if isinstance(self._storage, bytearray) else self._storage
