"""The host tier's copies overlapped with the forward, layer by layer: the same bytes land where the reference (every
copy before the forward) puts them, a layer is handed to the forward once its own copies are done (not after every
layer's), the step's device copies and state resets come after a layer's demotions, and a failing copy fails the
step instead of hanging it."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from deltaserve.cache.host_tier import HostCopies
from deltaserve.cache.spec import KVCacheSpec, StateCacheSpec
from deltaserve.layers.forward_batch import KDALayerCache, MLALayerCache
from deltaserve.runner.host_cache import HostCache, HostCopyJob, _ThreadJob
from deltaserve.runner.kv_tensors import allocate_layer_caches
from deltaserve.runner.staged_caches import StagedCaches

SPECS = [StateCacheSpec(layer_id=0, recurrent_shape=(2, 4, 4), recurrent_dtype="float32", conv_shape=(24, 3),
                        conv_dtype="float32"),
         KVCacheSpec(layer_id=1, row_width=12, dtype="float32"),
         StateCacheSpec(layer_id=2, recurrent_shape=(2, 4, 4), recurrent_dtype="float32", conv_shape=(24, 3),
                        conv_dtype="float32"),
         KVCacheSpec(layer_id=3, row_width=12, dtype="float32")]
BLOCK = 8


def random_caches(num_blocks: int, num_slots: int, seed: int) -> list:
    torch.manual_seed(seed)
    caches = allocate_layer_caches(SPECS, num_blocks=num_blocks, block_size=BLOCK, num_slots=num_slots)
    for c in caches:
        for t in ((c.state, c.conv) if isinstance(c, KDALayerCache) else (c.kv,)):
            t.copy_(torch.randn_like(t))
    return caches


def tensors(caches: list) -> list[torch.Tensor]:
    return [t for c in caches for t in ((c.state, c.conv) if isinstance(c, KDALayerCache) else (c.kv,))]


def random_copies(rng: random.Random) -> HostCopies:
    """Demotions and promotions with distinct targets (as the host tier hands them out), partial blocks included."""
    dev_blocks, host_blocks = rng.sample(range(16), 10), rng.sample(range(24), 10)
    dev_slots, host_slots = rng.sample(range(6), 4), rng.sample(range(8), 4)
    return HostCopies(blocks_out=list(zip(dev_blocks[:5], host_blocks[:5], strict=True)),
                      states_out=list(zip(dev_slots[:2], host_slots[:2], strict=True)),
                      blocks_in=[(h, d, rng.choice([BLOCK, rng.randint(1, BLOCK - 1)]))
                                 for h, d in zip(host_blocks[5:], dev_blocks[5:], strict=True)],
                      states_in=list(zip(host_slots[2:], dev_slots[2:], strict=True)))


@pytest.mark.parametrize("seed", range(5))
def test_overlapped_copies_equal_the_reference(seed):
    """Both jobs through `StagedCaches` with the same step (copies, then a device copy and a reset per layer): every
    device and host tensor ends bit-identical, whichever order the forward reaches the layers in."""
    rng = random.Random(seed)
    copies = random_copies(rng)
    results = []
    for overlap in (False, True):
        host = HostCache(SPECS, num_blocks=24, num_slots=8, block_size=BLOCK, device=torch.device("cpu"),
                         overlap=overlap)
        for h, d in zip(host.caches, random_caches(24, 8, seed=100 + seed), strict=True):
            for a, b in zip(tensors([h]), tensors([d]), strict=True):
                a.copy_(b)
        device = random_caches(16, 7, seed=seed)
        reset, (src, dst) = copies.states_out[0][0], (copies.states_in[1][1], 6)

        def prepare(cache, reset=reset, src=src, dst=dst):
            if isinstance(cache, KDALayerCache):  # a promoted checkpoint copied on, a demoted slot reused (zeroed)
                cache.state[dst].copy_(cache.state[src])
                cache.state[reset].zero_()
        staged = StagedCaches(device, host.start(copies, device), prepare)
        for i in rng.sample(range(len(SPECS)), 2):
            staged[i]
        staged.finish()
        results.append((tensors(device), tensors(host.caches), host.bytes_in, host.bytes_out))
    (dev_a, host_a, in_a, out_a), (dev_b, host_b, in_b, out_b) = results
    assert all(torch.equal(a, b) for a, b in zip(dev_a + host_a, dev_b + host_b, strict=True))
    assert (in_a, out_a) == (in_b, out_b) and in_a > 0 and out_a > 0
    # And the copies did what they say: a demoted block and slot are in the host (the slot as it was before this
    # step zeroed it), a promoted partial block's rows on the device.
    before = random_caches(16, 7, seed=seed)
    kv_dev, kv_host = device[1].kv, host.caches[1].kv
    d, h = copies.blocks_out[0]
    assert torch.equal(kv_host[h], before[1].kv[d])
    d, h = copies.states_out[0]
    assert torch.equal(host.caches[2].state[h], before[2].state[d]) and not device[2].state[d].any()
    h, d, rows = copies.blocks_in[0]
    assert torch.equal(kv_dev[d, :rows], kv_host[h, :rows])


def test_a_layer_is_handed_out_once_its_own_copies_are_done():
    """Layer 1's copy cannot finish until the forward has had layer 0: a job that waited for every layer before
    handing out the first would never hand it out (the test's event waits are bounded, so that fails, not hangs)."""
    took_layer0 = threading.Event()
    done = [False, False]

    def layer0() -> None:
        done[0] = True

    def layer1() -> None:
        assert took_layer0.wait(timeout=30), "layer 1's copy ran to completion before layer 0 was handed out"
        done[1] = True

    seen = []
    staged = StagedCaches(["c0", "c1"], _ThreadJob([layer0, layer1]), lambda cache: seen.append(cache))
    assert staged[0] == "c0" and done[0] and not done[1]
    took_layer0.set()
    assert list(staged) == ["c0", "c1"] and done[1]
    staged.finish()
    assert seen == ["c0", "c1"]  # each layer prepared once, after its copies


def test_a_failing_copy_fails_the_step_instead_of_hanging():
    def fine() -> None:
        pass

    def broken() -> None:
        raise OSError("device lost")

    staged = StagedCaches(["a", "b", "c"], _ThreadJob([fine, broken, fine]), lambda cache: None)
    with pytest.raises(RuntimeError, match="host-tier copy failed"):
        list(staged)  # layer 1 at the latest (layer 0 too, when the thread failed before the forward got there)
    with pytest.raises(RuntimeError, match="device lost"):
        staged.finish()


def test_a_step_without_copies_prepares_each_layer_once():
    seen = []
    staged = StagedCaches(["a", "b"], HostCopyJob(), seen.append)
    assert staged[-1] == "b" and staged[0:1] == ["a"]
    assert staged.finish() == 0.0 and seen == ["b", "a"]


@pytest.mark.gpu
def test_stream_copies_on_cuda_equal_the_reference():
    """The copy stream with pinned host memory: the same bytes as the reference, with the compute stream ordered
    after each layer's event."""
    copies = random_copies(random.Random(7))
    results = []
    for overlap in (False, True):
        host = HostCache(SPECS, num_blocks=24, num_slots=8, block_size=BLOCK, device=torch.device("cuda"),
                         overlap=overlap)
        for h, d in zip(host.caches, random_caches(24, 8, seed=3), strict=True):
            for a, b in zip(tensors([h]), tensors([d]), strict=True):
                a.copy_(b)
        device = [KDALayerCache(c.state.cuda(), c.conv.cuda()) if isinstance(c, KDALayerCache)
                  else MLALayerCache(c.kv.cuda()) for c in random_caches(16, 6, seed=4)]
        staged = StagedCaches(device, host.start(copies, device), lambda cache: None)
        sums = [sum(t.double().sum() for t in tensors([c])) for c in staged]  # compute that reads each layer
        assert staged.finish() >= 0
        results.append((tensors(device), tensors(host.caches), torch.stack(sums).cpu()))
    (dev_a, host_a, s_a), (dev_b, host_b, s_b) = results
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(dev_a + host_a, dev_b + host_b, strict=True))
    assert torch.equal(s_a, s_b)
