"""`pack_many` / `unpack_many` (the disaggregation payload's blocks) lay entries out exactly as `pack` / `unpack`
do, one after the other, for MLA blocks and KDA states, and refuse a wrong length without writing."""

from __future__ import annotations

import torch

from deltaserve.layers.forward_batch import KDALayerCache, MLALayerCache
from deltaserve.runner.shared_io import pack, pack_many, unpack, unpack_many


def caches(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [KDALayerCache(state=torch.randn(5, 2, 4, 4, generator=g), conv=torch.randn(5, 24, 3, generator=g)),
            MLALayerCache(kv=torch.randn(9, 4, 6, generator=g)),
            KDALayerCache(state=torch.randn(5, 2, 4, 4, generator=g), conv=torch.randn(5, 24, 3, generator=g)),
            MLALayerCache(kv=torch.randn(9, 4, 6, generator=g).to(torch.bfloat16))]


def test_pack_many_is_pack_concatenated():
    src = caches(0)
    for kind, indices in (("kv", [3, 0, 7]), ("state", [4, 1])):
        assert pack_many(src, kind, indices) == b"".join(pack(src, kind, i) for i in indices)
    assert pack_many(src, "kv", []) == b""


def test_unpack_many_writes_what_unpack_writes():
    src, a, b = caches(0), caches(1), caches(1)
    data = pack_many(src, "kv", [2, 5, 6])
    assert unpack_many(data, a, "kv", [8, 1, 4])
    width = len(data) // 3
    for j, dst in enumerate([8, 1, 4]):
        assert unpack(data[j * width:(j + 1) * width], b, "kv", dst)
    for x, y in zip(a, b, strict=True):
        for name in ("kv",) if isinstance(x, MLALayerCache) else ("state", "conv"):
            assert torch.equal(getattr(x, name), getattr(y, name))
    assert torch.equal(a[1].kv[8], src[1].kv[2]) and torch.equal(a[3].kv[4], src[3].kv[6])


def test_unpack_many_refuses_a_wrong_length():
    dst = caches(2)
    before = [c.kv.clone() for c in dst if isinstance(c, MLALayerCache)]
    data = pack_many(caches(3), "kv", [0, 1])
    assert not unpack_many(data[:-1], dst, "kv", [0, 1])
    assert all(torch.equal(x, c.kv) for x, c in zip(before, [c for c in dst if isinstance(c, MLALayerCache)],
                                                     strict=True))
