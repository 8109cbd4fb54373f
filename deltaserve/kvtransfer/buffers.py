"""Receive buffers that a fetch returns without a copy.

A fetch writes the payload into fresh storage and hands that storage out as a read-only `memoryview` (no copy into
a `bytes`: reading into a buffer and converting costs one more pass over the payload, which on these machines
halves a fetch's throughput: fresh pages are faulted in twice, 0.55 GB/s against 1.3 GB/s for a 256 MiB TCP read).
The storage is a numpy array from `np.empty`: mapped lazily (not zero-filled first, as a bytearray would be),
mutable by its owner, so the socket, the shared-memory read, NIXL or Mooncake write into it legitimately.

Large buffers are also advised into transparent huge pages before their first touch: faulting fresh 4 KiB pages in
is what bounds a receive here (64 MiB: 1.2 GB/s with 4 KiB pages, 2.6 GB/s with 2 MiB pages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import numpy as np

_HUGE_PAGE = 2 << 20
_SMALL_PAGE = 4096
_MADV_HUGEPAGE = 14  # Linux
_ADVISE_FROM = 4 << 20
"""Smaller buffers are not worth a system call."""


class ReceiveBuffer:
    """Storage a transfer writes into (`view`, or `address` for the transfer libraries), then `take`n read-only."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._storage = np.empty(nbytes, dtype=np.uint8)
        self.address = int(self._storage.ctypes.data) if nbytes else 0
        if nbytes >= _ADVISE_FROM:
            _advise_huge_pages(self.address, nbytes)
        self.view = memoryview(self._storage.data)

    def prefault(self) -> None:
        """Touches every page now, for writers that fault fresh pages in far more slowly than this loop does
        (Mooncake's TCP transport, 64 MiB, alternating rounds: 0.63 GB/s with it, 0.45 without; NIXL over UCX
        is slower with it, 0.43 against 0.56, so it does not call this)."""
        if self.nbytes:
            self._storage[::_SMALL_PAGE] = 0

    def take(self) -> memoryview:
        """The payload, read-only (call once, after the last write; drop `view` and `address` then)."""
        self.view.release()
        return self._storage.data.toreadonly()


def _advise_huge_pages(address: int, nbytes: int) -> None:
    """MADV_HUGEPAGE over the whole 2 MiB pages inside [address, address + nbytes); a no-op where unsupported."""
    madvise = _madvise()
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if madvise is not None and end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # an error (no THP) leaves ordinary pages: nothing to handle


@functools.cache
def _madvise() -> ctypes._NamedFuncPointer | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
