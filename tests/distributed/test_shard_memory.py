"""Each rank's share of the model and of the state cache, measured from the tensors it loads: sharded tensors are
1/TP of the unsharded ones and the ranks' shards put together are the checkpoint tensor; only the documented
tensors (norms, router, low-rank gate inputs, MLA's latent projection, K3's latent down/up) stay whole."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.spec import StateCacheSpec
from deltaserve.distributed import ParallelGroup
from deltaserve.models.loader import load_model

REPLICATED = ("layernorm", "norm", "gate_weight", "correction_bias", "kv_a_proj", "routed_expert_down_proj",
              "routed_expert_up_proj", "attn_res", "_res.")


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.mark.parametrize(("variant", "tp", "ep"), [("base", 2, False), ("base", 4, False), ("k3", 2, False),
                                                   ("k3", 2, True), ("qlora-2shared-bsmoe", 2, False)])
def test_rank_shards_are_one_over_tp(tiny_dir, variant, tp, ep):
    path = tiny_dir(variant)
    whole = load_model(path)
    ranks = [load_model(path, tp=ParallelGroup(rank=r, size=tp), expert_parallel=ep) for r in range(tp)]
    full = params(whole)
    sharded = 0
    for name, t in params(ranks[0]).items():
        ratio = full[name].numel() / t.numel()
        if name.endswith("A_log"):  # the rank's heads' entries (K3's zero padding to 128 is not kept)
            assert ratio >= tp and t.numel() == whole.config.kda.num_heads // tp, name
            continue
        if name.startswith(("embed_tokens", "lm_head")) or ".experts" in name or name.endswith(("w13", "w2")):
            assert ratio == tp, name  # vocabulary rows, routed experts (sharded or partitioned)
        elif any(k in name for k in REPLICATED) or "in_proj" in name or name.endswith(("o_norm.weight",)):
            assert ratio in (1, tp) or 1 < ratio < tp, name  # whole, or a fused GEMM of whole and sharded parts
        else:
            assert ratio == tp, name
        if ratio == tp:
            sharded += 1
            if name.endswith("gate_up") or (name.endswith("w13") and not ep):
                continue  # fused gate | up rows: each rank holds its gate rows then its up rows
            dim = next(d for d in range(t.dim()) if t.shape[d] != full[name].shape[d])
            # Expert parallelism stacks whole experts by rank; everything else is contiguous along its split dim.
            assert torch.equal(torch.cat([params(m)[name] for m in ranks], dim=dim), full[name]), name
    assert sharded > 20
    total = sum(t.numel() * t.element_size() for t in params(ranks[0]).values())
    whole_bytes = sum(t.numel() * t.element_size() for t in full.values())
    assert total < 0.75 * whole_bytes if tp == 2 else total < 0.5 * whole_bytes


@pytest.mark.parametrize("tp", [2, 4])
def test_state_slot_is_one_over_tp(tiny_dir, tp):
    """A KDA state slot (recurrent state and conv window) holds only the rank's heads; MLA rows stay whole."""
    path = tiny_dir("base")
    one = load_model(path).cache_specs()
    part = load_model(path, tp=ParallelGroup(rank=tp - 1, size=tp)).cache_specs()
    for a, b in zip(one, part, strict=True):
        if isinstance(a, StateCacheSpec):
            assert a.bytes_per_slot == tp * b.bytes_per_slot
        else:
            assert a == b
