"""Memory this host can still give: the kernel's estimate of available pages, within the cgroup's limit."""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def meminfo_available_bytes(meminfo: str) -> int | None:
    """MemAvailable from the text of /proc/meminfo, in bytes; None when the kernel does not report it."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip() == "kB" else 1)
    return None


def cgroup_headroom_bytes(limit: str, current: str, stat: str) -> int | None:
    """What a cgroup v2 may still allocate: memory.max less its working set (memory.current less the inactive page
    cache, which the kernel reclaims before it refuses; Kubernetes' measure); None without a limit ('max')."""
    if limit.strip() == "max":
        return None
    inactive_file = 0
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name == "inactive_file":
            inactive_file = int(value)
    return max(int(limit) - (int(current) - inactive_file), 0)


def available_host_bytes() -> int:
    """Bytes this process can allocate now without swapping or being killed.

    MemAvailable, not MemFree: page cache (checkpoints just read, files written) is reclaimable, and counting it as
    used makes a busy host look full (the free pages fall below a cache budget while gigabytes are available). A
    container's cgroup limit caps it, since the host's memory is not the container's."""
    try:
        available = meminfo_available_bytes(MEMINFO.read_text())
    except OSError:
        available = None
    if available is None:  # not Linux, or a kernel before 3.14: the free pages, an underestimate
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        files = (CGROUP / f"memory.{name}" for name in ("max", "current", "stat"))
        headroom = cgroup_headroom_bytes(*(f.read_text() for f in files))
    except (OSError, ValueError):
        headroom = None
    return available if headroom is None else min(available, headroom)
