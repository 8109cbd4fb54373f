"""The host's available memory counts reclaimable page cache as available, and a cgroup limit caps it."""

from __future__ import annotations

from deltaserve.utils.host_memory import cgroup_headroom_bytes, meminfo_available_bytes

MEMINFO = """MemTotal:       24000000 kB
MemFree:          600000 kB
MemAvailable:   21000000 kB
Buffers:          100000 kB
Cached:         20000000 kB
"""


def test_meminfo_available_counts_the_page_cache():
    """A host whose free pages are mostly page cache is not full: MemAvailable, not MemFree."""
    assert meminfo_available_bytes(MEMINFO) == 21000000 * 1024
    assert meminfo_available_bytes("MemTotal: 1 kB\nMemFree: 1 kB\n") is None  # an old kernel: the caller falls back


def test_cgroup_headroom_is_the_limit_less_the_working_set():
    stat = "anon 1000\nfile 5000\nactive_file 1000\ninactive_file 4000\n"
    assert cgroup_headroom_bytes("max\n", "6000\n", stat) is None
    assert cgroup_headroom_bytes("10000\n", "6000\n", stat) == 10000 - (6000 - 4000)
    assert cgroup_headroom_bytes("1000\n", "6000\n", "inactive_file 0\n") == 0

