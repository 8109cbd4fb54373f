"""Memory this host can still give: the kernel's estimate of available pages, within the limits of its memory cgroups
(v2 or v1, the process's own and every ancestor's)."""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
V1_UNLIMITED = 1 << 62
"""cgroup v1 reports no limit as a page-rounded 2**63 - 1: anything this large is none."""


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


def memory_cgroup_dirs(proc_cgroup: str, root: Path) -> list[tuple[str, Path]]:
    """This process's memory cgroup and its ancestors, leaf first, as (version, directory) under the cgroup mount
    `root`, from the text of /proc/self/cgroup: v2's unified line `0::/path`, or a v1 `N:...memory...:/path` line
    (its files under `root/memory`). A limit may sit on any ancestor; a container with its own cgroup namespace sees
    its cgroup as `/`, the mount's root. Directories that do not exist are left out."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (root / "cgroup.controllers").exists():
            version, base = "v2", root
        elif "memory" in controllers.split(","):
            version, base = "v1", root / "memory"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
        return [(version, d) for d in dirs if d.is_dir()]
    return []


def _headroom(version: str, directory: Path) -> int | None:
    if version == "v2":
        files = ("memory.max", "memory.current", "memory.stat")
        return cgroup_headroom_bytes(*((directory / f).read_text() for f in files))
    limit = (directory / "memory.limit_in_bytes").read_text()
    if int(limit) >= V1_UNLIMITED:
        return None
    # v1's usage counts the whole subtree: so does total_inactive_file (inactive_file is this cgroup's own)
    lines = (directory / "memory.stat").read_text().splitlines()
    stat = "\n".join(line.removeprefix("total_") for line in lines if line.startswith("total_inactive_file "))
    return cgroup_headroom_bytes(limit, (directory / "memory.usage_in_bytes").read_text(), stat)


def cgroup_available_bytes(proc_cgroup: str, root: Path) -> int | None:
    """The smallest headroom of the memory cgroups this process is in (its own and every ancestor's, v1 or v2);
    None without any limit, or where the files cannot be read."""
    found = None
    for version, directory in memory_cgroup_dirs(proc_cgroup, root):
        try:
            headroom = _headroom(version, directory)
        except (OSError, ValueError):
            continue
        if headroom is not None:
            found = headroom if found is None else min(found, headroom)
    return found


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
        headroom = cgroup_available_bytes(PROC_CGROUP.read_text(), CGROUP)
    except (OSError, ValueError):
        headroom = None
    return available if headroom is None else min(available, headroom)
