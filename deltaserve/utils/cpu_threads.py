"""How many torch threads a CPU engine runs, and on which cores.

The engine process runs on the cores of its affinity mask (`taskset -c 4-15 deltaserve serve ...`, `numactl
--physcpubind`, a container's cpuset): torch's OpenMP pool is sized from that mask and its threads stay inside it,
so pinning is done from outside, as for any process. Within the mask the server leaves one core to its API process
(HTTP, tokenising, detokenising, streaming), which otherwise preempts a GEMM thread every few milliseconds and
stalls the whole step at its next barrier.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on: its affinity mask where the OS has one, else the CPU count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_num_threads(reserved: int = 0) -> int:
    """The engine's torch threads when none are given: the available cores less `reserved` (the server reserves one
    for its API process), at least one."""
    return max(1, available_cores() - reserved)
