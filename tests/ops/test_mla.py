"""Parity of deltaserve.ops.mla (paged latent cache, expanded prefill, latent decode absorbed as the layer does;
spec §4)."""

from __future__ import annotations

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from deltaserve.ops.mla import mla_decode, mla_prefill, mla_write_cache
from deltaserve.ops.norm import rms_norm

HEADS, NOPE, ROPE, V_DIM, RANK = 3, 12, 8, 10, 24
SCALE = (NOPE + ROPE) ** -0.5



def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, rtol: float) -> None:
    """Fail on NaN, shape or dtype mismatch, or a max-abs error above ``rtol * max|ref|``; report both errors."""
    assert not torch.isnan(out).any(), f"{name}: output has NaN"
    assert not torch.isnan(ref).any(), f"{name}: reference has NaN"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    abs_err = (out.double() - ref.double()).abs().max().item()
    rel_err = abs_err / max(ref.double().abs().max().item(), 1e-30)
    assert rel_err <= rtol, f"{name}: abs err {abs_err:.3e}, rel err {rel_err:.3e} > {rtol:.1e}"


class PagedCache:
    """A NaN-filled paged cache whose sequences own shuffled, non-contiguous blocks."""

    def __init__(self, g: torch.Generator, lengths: list[int], block_size: int, dtype: torch.dtype) -> None:
        self.block_size = block_size
        needed = [-(-n // block_size) for n in lengths]
        num_blocks = sum(needed) + 3  # spare blocks stay NaN and must never be read
        perm = torch.randperm(num_blocks, generator=g).tolist()
        max_blocks = max(needed) + 1  # one padding column on every row
        self.block_tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int64)
        for i, n in enumerate(needed):
            self.block_tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int64)
            perm = perm[n:]
        self.kv_cache = torch.full((num_blocks, block_size, RANK + ROPE), float("nan"), dtype=dtype)

    def slots(self, seq: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return self.block_tables[seq, pos // self.block_size] * self.block_size + pos % self.block_size


def dense_mla(q: torch.Tensor, latents: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """Direct expanded causal MLA in float64 for one sequence: q [Lq, Hm, Dq] are the last Lq of L positions."""
    q, latents, kv_b = q.double(), latents.double(), kv_b.double()
    c, kr = latents[:, :RANK], latents[:, RANK:]
    w = kv_b.view(HEADS, NOPE + V_DIM, RANK)
    k_nope = torch.einsum("lr,hdr->hld", c, w[:, :NOPE])  # [Hm, L, Dn]
    v = torch.einsum("lr,hdr->hld", c, w[:, NOPE:])  # [Hm, L, Dv]
    k = torch.cat([k_nope, kr[None].expand(HEADS, -1, -1)], dim=-1)  # [Hm, L, Dq]
    num_q, num_ctx = q.shape[0], latents.shape[0]
    scores = torch.einsum("qhd,hld->hql", q, k) * SCALE
    q_pos = torch.arange(num_ctx - num_q, num_ctx)
    scores = scores.masked_fill(torch.arange(num_ctx)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hql,hlv->qhv", scores.softmax(-1), v)


def random_problem(
    g: torch.Generator, lengths: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Per sequence latents [L, R+Dr] and queries [L, Hm, Dq], plus kv_b_weight [Hm*(Dn+Dv), R]."""
    latents = [torch.randn(n, RANK + ROPE, generator=g) for n in lengths]
    queries = [torch.randn(n, HEADS, NOPE + ROPE, generator=g) for n in lengths]
    kv_b = torch.randn(HEADS * (NOPE + V_DIM), RANK, generator=g) / RANK**0.5
    return latents, queries, kv_b


def split_kv_b(kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [Hm*(Dn+Dv), R] -> W_uk [Hm, Dn, R], W_uv [Hm, Dv, R] (views, as the layer passes them)."""
    w = kv_b.view(HEADS, NOPE + V_DIM, RANK)
    return w[:, :NOPE], w[:, NOPE:]


def prefill(q: torch.Tensor, cache: PagedCache, cu: torch.Tensor, ctx: torch.Tensor, kv_b: torch.Tensor):
    return mla_prefill(q, cache.kv_cache, cache.block_tables, cu, ctx, *split_kv_b(kv_b), scale=SCALE)


def absorbed_decode(q: torch.Tensor, cache: PagedCache, ctx: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """The layer's decode: latent query [W_uk^T q_n ; q_r], mla_decode, then W_uv: [N, Hm, Dq] -> [N, Hm, Dv]."""
    w_uk, w_uv = split_kv_b(kv_b.to(q.dtype))
    q_latent = torch.cat([torch.einsum("nhd,hdr->nhr", q[..., :NOPE], w_uk), q[..., NOPE:]], dim=-1)
    o_latent = mla_decode(q_latent, cache.kv_cache, cache.block_tables, ctx, kv_lora_rank=RANK, scale=SCALE)
    assert o_latent.shape == (q.shape[0], HEADS, RANK) and o_latent.dtype == q.dtype
    return torch.einsum("nhr,hvr->nhv", o_latent, w_uv)


def write_all(cache: PagedCache, latents: list[torch.Tensor], ends: list[int], starts: list[int] | None = None) -> None:
    starts = starts or [0] * len(latents)
    for i, lat in enumerate(latents):
        mla_write_cache(lat[starts[i] : ends[i]], cache.kv_cache, cache.slots(i, starts[i], ends[i]))


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


LENGTHS = [1, 5, 17, 9, 4]
BLOCK_SIZES = [pytest.param(4, id="block4"), pytest.param(16, id="block16")]


def test_mla_write_cache_rows() -> None:
    """Each latent lands in exactly the row its slot names; every other row is left alone."""
    g = torch.Generator().manual_seed(0)
    cache = PagedCache(g, [6], block_size=4, dtype=torch.float32)
    latent = torch.randn(6, RANK + ROPE, generator=g)
    slots = cache.slots(0, 0, 6)
    mla_write_cache(latent, cache.kv_cache, slots)
    flat = cache.kv_cache.view(-1, RANK + ROPE)
    assert torch.equal(flat[slots], latent)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(flat[untouched]).all()


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mla_prefill(block_size: int) -> None:
    """Expanded prefill over shuffled paged blocks == a dense causal MLA, for a varlen batch of full prompts."""
    g = torch.Generator().manual_seed(1)
    latents, queries, kv_b = random_problem(g, LENGTHS)
    cache = PagedCache(g, LENGTHS, block_size, torch.float32)
    write_all(cache, latents, LENGTHS)
    out = prefill(torch.cat(queries), cache, cu_of(LENGTHS), torch.tensor(LENGTHS), kv_b)
    ref = torch.cat([dense_mla(q, lat, kv_b) for q, lat in zip(queries, latents, strict=True)])
    assert out.dtype == torch.float32
    assert_close("mla_prefill", ref, out, 1e-5)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mla_prefill_chunked(block_size: int) -> None:
    """A second query chunk attends to the first chunk's cached latents: two chunks == one shot."""
    g = torch.Generator().manual_seed(2)
    first = [1, 3, 9, 4, 2]
    latents, queries, kv_b = random_problem(g, LENGTHS)
    cache = PagedCache(g, LENGTHS, block_size, torch.float32)
    write_all(cache, latents, first)  # only the first chunk is cached for the first call
    out1 = prefill(torch.cat([q[:a] for q, a in zip(queries, first, strict=True)]), cache, cu_of(first),
                   torch.tensor(first), kv_b)
    write_all(cache, latents, LENGTHS, starts=first)
    second = [n - a for n, a in zip(LENGTHS, first, strict=True)]
    out2 = prefill(torch.cat([q[a:] for q, a in zip(queries, first, strict=True)]), cache, cu_of(second),
                   torch.tensor(LENGTHS), kv_b)
    one_shot = prefill(torch.cat(queries), cache, cu_of(LENGTHS), torch.tensor(LENGTHS), kv_b)
    c1, c2 = cu_of(first).tolist(), cu_of(second).tolist()
    chunked = torch.cat([torch.cat([out1[c1[i] : c1[i + 1]], out2[c2[i] : c2[i + 1]]]) for i in range(len(LENGTHS))])
    assert_close("mla_prefill_chunked", one_shot, chunked, 1e-6)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(
    ("dtype", "rtol"), [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.float64, 1e-12, id="fp64")]
)
def test_mla_decode_absorbed(block_size: int, dtype: torch.dtype, rtol: float) -> None:
    """Latent decode (MQA over the cache rows) with the layer's absorption == expanded prefill with one query per
    sequence."""
    g = torch.Generator().manual_seed(3)
    latents, queries, kv_b = random_problem(g, LENGTHS)
    cache = PagedCache(g, LENGTHS, block_size, dtype)
    write_all(cache, [lat.to(dtype) for lat in latents], LENGTHS)
    q = torch.stack([qs[-1] for qs in queries]).to(dtype)  # [N, Hm, Dq]
    ctx = torch.tensor(LENGTHS)
    absorbed = absorbed_decode(q, cache, ctx, kv_b.to(dtype))
    expanded = prefill(q, cache, cu_of([1] * len(LENGTHS)), ctx, kv_b.to(dtype))
    assert absorbed.dtype == dtype
    assert_close("mla_decode", expanded, absorbed, rtol)
    ref = torch.stack([dense_mla(qs[-1:], lat, kv_b)[0] for qs, lat in zip(queries, latents, strict=True)])
    assert_close("mla_decode_vs_dense", ref, absorbed.double(), max(rtol, 1e-12))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mla_decode_latent_attention(block_size: int) -> None:
    """mla_decode is MQA of every head over the sequence's cache rows [c ; kr], with the latent c as the value."""
    g = torch.Generator().manual_seed(5)
    latents, _, _ = random_problem(g, LENGTHS)
    cache = PagedCache(g, LENGTHS, block_size, torch.float32)
    write_all(cache, latents, LENGTHS)
    q = torch.randn(len(LENGTHS), HEADS, RANK + ROPE, generator=g)
    out = mla_decode(q, cache.kv_cache, cache.block_tables, torch.tensor(LENGTHS), kv_lora_rank=RANK, scale=SCALE)
    ref = torch.stack([
        torch.einsum("hl,lr->hr", (SCALE * torch.einsum("hk,lk->hl", q[i].double(), lat.double())).softmax(-1),
                     lat[:, :RANK].double())
        for i, lat in enumerate(latents)
    ])
    assert out.shape == (len(LENGTHS), HEADS, RANK)
    assert_close("mla_decode_latent", ref, out.double(), 1e-6)


@pytest.mark.parametrize("with_chunk", [pytest.param(False, id="one_shot"), pytest.param(True, id="chunk_then_decode")])
def test_mla_matches_transformers_attention(with_chunk: bool) -> None:
    """The op pipeline (own q / latent, rms-normed cache rows, o_proj) == KimiLinearAttention forward, no q-LoRA."""
    torch.manual_seed(0)  # module initialisation; all weights are then re-drawn from g
    g = torch.Generator().manual_seed(4)
    hidden, num_tokens, eps = 40, 11, 1e-6
    config = KimiLinearConfig(
        vocab_size=64,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=None,
        kv_lora_rank=RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "eager"
    attn = KimiLinearAttention(config, layer_idx=1).eval()
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=g))
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 1.5 / param.shape[-1] ** 0.5)
    x = torch.randn(1, num_tokens, hidden, generator=g)
    mask = torch.full((num_tokens, num_tokens), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = attn(x, attention_mask=mask)

        h = x[0]
        q = attn.q_proj(h).view(num_tokens, HEADS, NOPE + ROPE)
        ckv = attn.kv_a_proj_with_mqa(h)
        latent = torch.cat([rms_norm(ckv[:, :RANK], attn.kv_a_layernorm.weight, eps), ckv[:, RANK:]], dim=-1)
        cache = PagedCache(g, [num_tokens], block_size=4, dtype=torch.float32)
        mla_write_cache(latent, cache.kv_cache, cache.slots(0, 0, num_tokens))
        kv_b = attn.kv_b_proj.weight
        if with_chunk:  # prefill the first 7 queries, then decode the remaining 4 one at a time
            parts = [prefill(q[:7], cache, cu_of([7]), torch.tensor([7]), kv_b)]
            for t in range(7, num_tokens):
                parts.append(absorbed_decode(q[t : t + 1], cache, torch.tensor([t + 1]), kv_b))
            o = torch.cat(parts)
        else:
            o = prefill(q, cache, cu_of([num_tokens]), torch.tensor([num_tokens]), kv_b)
        out = attn.o_proj(o.reshape(num_tokens, HEADS * V_DIM))
    assert attn.scaling == SCALE
    assert_close("mla_vs_transformers", ref[0], out, 1e-5)
