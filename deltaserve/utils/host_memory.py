"""Free physical memory of this host."""

from __future__ import annotations

import os


def available_host_bytes() -> int:
    """Bytes of physical memory free now (the kernel's available pages)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
