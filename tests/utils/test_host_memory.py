"""The host's available memory counts reclaimable page cache as available, and a cgroup limit caps it."""

from __future__ import annotations

from deltaserve.utils.host_memory import (
    cgroup_available_bytes,
    cgroup_headroom_bytes,
    meminfo_available_bytes,
    memory_cgroup_dirs,
)

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



def _write(directory, **files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_a_nested_cgroup_v2_and_its_ancestors_limit_the_headroom(tmp_path):
    """A process in /a/b of a cgroup v2 tree: the tightest limit of b, a and the root counts, wherever it sits."""
    stat = "inactive_file 0\n"
    _write(tmp_path, cgroup_controllers="memory\n", memory_max="max\n", memory_current="0\n", memory_stat=stat)
    _write(tmp_path / "a", memory_max="5000\n", memory_current="1000\n", memory_stat=stat)
    _write(tmp_path / "a" / "b", memory_max="max\n", memory_current="800\n", memory_stat=stat)
    proc = "0::/a/b\n"
    assert [d for _, d in memory_cgroup_dirs(proc, tmp_path)] == [tmp_path / "a" / "b", tmp_path / "a", tmp_path]
    assert cgroup_available_bytes(proc, tmp_path) == 4000  # a's limit: 5000 less its 1000
    assert cgroup_available_bytes("0::/\n", tmp_path) is None  # a namespace root without a limit


def test_cgroup_v1_memory_controller(tmp_path):
    """A hybrid host (this CI machine's kind): the v1 memory line names the cgroup; 2**63-ish means no limit."""
    proc = "4:memory:/jobs/j1\n1:cpu:/\n0::/\n"
    memory = tmp_path / "memory"
    _write(memory, memory_limit_in_bytes="9223372036854771712\n", memory_usage_in_bytes="9\n",
           memory_stat="inactive_file 0\n")
    _write(memory / "jobs" / "j1", memory_limit_in_bytes="9223372036854771712\n", memory_usage_in_bytes="7\n",
           memory_stat="inactive_file 0\n")
    assert cgroup_available_bytes(proc, tmp_path) is None
    _write(memory / "jobs" / "j1", memory_limit_in_bytes="10000\n", memory_usage_in_bytes="7000\n",
           memory_stat="inactive_file 9\ntotal_inactive_file 2000\n")
    assert cgroup_available_bytes(proc, tmp_path) == 10000 - (7000 - 2000)  # the subtree's, as its usage is
    assert cgroup_available_bytes("0::/\n1:cpu:/\n", tmp_path) is None  # no memory controller found: no limit
