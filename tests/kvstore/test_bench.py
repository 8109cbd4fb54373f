"""`python -m deltaserve.kvstore.bench`'s batched-read comparison on the real stores: both reads agree, and the
store keeps none of the benchmark's entries afterwards (a shared store given with --url is not littered)."""

from __future__ import annotations

from deltaserve.kvstore.bench import measure_batched
from deltaserve.kvstore.entry import store_key


def test_batched_read_comparison_leaves_nothing_behind(store_server):
    result = measure_batched(store_server.url, count=5, size_kib=4, repeat=1)
    assert result.count == 5 and result.one_by_one_s > 0 and result.batched_s > 0
    assert all(store_server.raw_get(store_key("bench-batched", f"kv/{i}")) is None for i in range(5))
