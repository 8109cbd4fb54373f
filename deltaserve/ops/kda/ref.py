"""Pure-PyTorch KDA (Kimi Delta Attention, model-spec §3.3-§3.8): decay gate, chunked varlen prefill over a state
pool (with prefix-cache checkpoints) and single-token recurrent decode. This is the specification and the test oracle.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# Element budget of the largest intra-chunk temporary per group of chunks: bounds prefill memory on long prompts.
_GROUP_ELEMS = 1 << 20


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    """Per-channel log-decay ``g`` (spec §3.3).

    Args:
        f: ``[T, H, K]`` raw gate input ``x Wfa^T Wfb^T`` (without ``dt_bias``).
        A_log: any shape holding at least ``H`` values (Kimi Linear ``[1, 1, H, 1]``, K3 ``[128]`` zero-padded);
            flattened, the first ``H`` are used.
        dt_bias: ``[H * K]``.
        lower_bound: ``None`` for Kimi Linear, ``g = -exp(A_log) * softplus(f + dt_bias)`` (softplus(z) = z for
            z > 20, as transformers); a negative float ``lb`` for K3, ``g = lb * sigmoid(exp(A_log) * (f + dt_bias))``.

    Returns:
        ``[T, H, K]`` log-decay, ``<= 0``, in fp32 (fp64 if ``f`` is fp64).
    """
    _, H, K = f.shape
    cdt = torch.promote_types(f.dtype, torch.float32)
    a = A_log.reshape(-1)[:H].to(cdt).exp().view(1, H, 1)
    z = f.to(cdt) + dt_bias.to(cdt).view(1, H, K)
    if lower_bound is None:
        return -a * F.softplus(z, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(a * z)


def _compute_dtype(*ts: Tensor) -> torch.dtype:
    """fp32, or fp64 when an input is fp64 (fp64 reference runs)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _qk_norm(q: Tensor, k: Tensor, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """L2-normalise q and k over the head dim (eps inside the sqrt, spec §3.2) and scale q by ``K**-0.5``."""
    q, k = q.to(cdt), k.to(cdt)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k


def kda_decode(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, state_indices: Tensor | slice
) -> Tensor:
    """One KDA token per row in the recurrent form (spec §3.5): decay, delta rule, read after the update.

    Args:
        q, k: ``[N, H, K]`` raw queries/keys (L2-normalised here), any float dtype.
        v: ``[N, H, V]``.
        g: ``[N, H, K]`` log-decay from ``kda_gate``.
        beta: ``[N, H]``, already sigmoid-ed.
        state_pool: ``[S, H, K, V]`` fp32 state pool, per slot ``[H, K (key rows), V (value cols)]`` as transformers.
            Row ``i`` reads and **updates in place** ``state_pool[state_indices[i]]``; indices must be distinct.
        state_indices: ``[N]`` int64 slots, or a ``slice`` of N consecutive slots (then updated where they lie,
            with no gather and scatter; same numbers).

    Returns:
        ``[N, H, V]`` output in ``q``'s dtype. Math in fp32 (fp64 if ``q`` or the pool is fp64).
    """
    cdt = _compute_dtype(q, state_pool)
    qn, kn = _qk_norm(q, k, cdt)
    if isinstance(state_indices, slice):
        view = state_pool[state_indices]
        S = view if view.dtype == cdt else view.to(cdt)  # the pool's own rows, updated in place below
    else:
        idx = state_indices.to(device=state_pool.device, dtype=torch.long)
        S = state_pool.index_select(0, idx).to(cdt)  # [N, H, K, V], a private copy updated in place below
    S.mul_(g.to(cdt).exp().unsqueeze(-1))
    delta = beta.to(cdt).unsqueeze(-1) * (v.to(cdt) - (kn.unsqueeze(-2) @ S).squeeze(-2))  # [N, H, V]
    S.add_(kn.unsqueeze(-1) * delta.unsqueeze(-2))
    if not isinstance(state_indices, slice):
        state_pool.index_copy_(0, idx, S.to(state_pool.dtype))
    elif S is not view:
        view.copy_(S)
    return (qn.unsqueeze(-2) @ S).squeeze(-2).to(q.dtype)


class _Layout(NamedTuple):
    """Chunks of all sequences in step-major order: step ``t`` holds chunk ``t`` of every sequence that has one, in
    rank order (sequences sorted by chunk count, descending), so the live states at step ``t`` are a prefix.

    Built from the host-side offsets: nothing is read back from the device (each read is a stream sync on a GPU)."""

    order: Tensor  # [N] sequence of each rank
    rank: list[int]  # [N] rank of each sequence
    offs: list[int]  # [steps + 1] first chunk id of each step
    cid: Tensor  # [T] chunk id of each token
    pos: Tensor  # [T] position of each token in its chunk


def _layout(cu: list[int], C: int, device: torch.device) -> _Layout:
    N, T = len(cu) - 1, cu[-1]
    lens = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    nch = [-(-n // C) for n in lens]
    order = sorted(range(N), key=lambda i: -nch[i])  # stable: ties keep sequence order
    rank = [0] * N
    for r, i in enumerate(order):
        rank[i] = r
    live = [sum(1 for n in nch if n > t) for t in range(max(nch, default=0))]  # sequences with a chunk at step t
    offs = [0]
    for count in live:
        offs.append(offs[-1] + count)
    seq = torch.repeat_interleave(torch.arange(N, device=device), torch.tensor(lens, device=device), output_size=T)
    p = torch.arange(T, device=device) - torch.tensor(cu[:-1], dtype=torch.int64, device=device)[seq]
    offs_t, rank_t = torch.tensor(offs, device=device), torch.tensor(rank, device=device)
    return _Layout(torch.tensor(order, device=device), rank, offs, offs_t[p // C] + rank_t[seq], p % C)


def _to_chunks(x: Tensor, lay: _Layout, C: int) -> Tensor:
    """``[T, H, *D]`` packed tokens -> ``[chunks, H, C, *D]``, zero-padded (zero k/beta/g leave the state unchanged)."""
    # A flat index_copy_ into [chunks * C, H, *D], then a transpose: much faster on CPU than an advanced-index
    # scatter into [chunks, H, C, *D].
    flat = x.new_zeros(lay.offs[-1] * C, *x.shape[1:]).index_copy_(0, lay.cid * C + lay.pos, x)
    return flat.view(lay.offs[-1], C, *x.shape[1:]).transpose(1, 2).contiguous()


def _decayed_scores(q: Tensor, k: Tensor, G: Tensor) -> Tensor:
    """``M[x, r, i] = sum_c x_r[c] k_i[c] exp(G_r[c] - G_i[c])`` for ``i <= r`` (0 above), rows ``x = q`` then ``k``.

    Args: q, k: ``[B, H, C, K]``; G: ``[B, H, C, K]`` fp64 in-chunk cumulative log-decay. Returns ``[2, B, H, C, C]``.
    """
    B, H, C, K = k.shape
    X = torch.stack((q, k))  # [2, B, H, C, K]
    M = X.new_zeros(2, B, H, C, C)
    # Off-diagonal halves, recursively: in a block [s, s + 2h), rows r of the right half meet columns i of the left
    # half through the reference p = s + h - 1: exp(G_r - G_i) = exp(G_r - G_p) * exp(G_p - G_i), both exponents
    # <= 0 since i <= p < r and g <= 0, so a matmul replaces the [C, C, K] tensor without any overflow (and if a
    # factor underflows, the exact product is below it). Diagonal blocks of the odd part of C remain (1 if C = 2^m).
    lf = C // (C & -C)
    h = C // 2
    while h >= lf:
        nb = C // (2 * h)
        Gv = G.unflatten(2, (nb, 2, h))  # [B, H, nb, 2, h, K]
        Gp = Gv[:, :, :, 0, h - 1 :]  # [B, H, nb, 1, K]
        rows = X.unflatten(3, (nb, 2, h))[:, :, :, :, 1] * (Gv[:, :, :, 1] - Gp).to(X.dtype).exp()  # [2,B,H,nb,h,K]
        cols = k.unflatten(2, (nb, 2, h))[:, :, :, 0] * (Gp - Gv[:, :, :, 0]).to(X.dtype).exp()  # [B, H, nb, h, K]
        blocks = M.unflatten(3, (nb, 2, h)).unflatten(-1, (nb, 2, h)).diagonal(dim1=3, dim2=6)[:, :, :, 1, :, 0]
        blocks.copy_((rows @ cols.transpose(-1, -2)).permute(0, 1, 2, 4, 5, 3))
        h //= 2
    # Diagonal leaf blocks: the exact masked form (mask before exp: G_r - G_i > 0 above the diagonal); for a
    # power-of-two C it is just x_r . k_r.
    n = C // lf
    idx = torch.arange(lf, device=k.device)
    tri = (idx[:, None] >= idx[None, :]).unsqueeze(-1)  # [r, i, 1]
    Gd = G.unflatten(2, (n, lf))
    kE = (
        k.unflatten(2, (n, lf)).unsqueeze(-3)
        * (Gd.unsqueeze(-2) - Gd.unsqueeze(-3)).masked_fill(~tri, -torch.inf).to(X.dtype).exp()
    )
    D = torch.einsum("xbhnrc,bhnric->xbhnri", X.unflatten(3, (n, lf)), kE)
    M.unflatten(3, (n, lf)).unflatten(-1, (n, lf)).diagonal(dim1=3, dim2=5).copy_(D.permute(0, 1, 2, 4, 5, 3))
    return M


class _Intra(NamedTuple):
    """State-independent chunk quantities (spec §3.7), each ``[B, H, C, *]``."""

    A: Tensor  # [B, H, C, C] decayed q.k, i <= r
    U: Tensor  # [B, H, C, V] M (beta V)
    W: Tensor  # [B, H, C, K] M (beta K exp(G))
    Qg: Tensor  # [B, H, C, K] q exp(G)
    Kd: Tensor  # [B, H, C, K] k exp(G_C - G)
    decay: Tensor  # [B, H, K] exp(G_C)


def _intra(q: Tensor, k: Tensor, v: Tensor, G: Tensor, beta: Tensor) -> _Intra:
    A, Mk = _decayed_scores(q, k, G).unbind(0)
    # (I + L) with L = beta_r * Mk strictly below the diagonal: solve_triangular ignores the diagonal and upper part.
    eG = G.to(q.dtype).exp()
    rhs = torch.cat((v, k * eG), -1) * beta.unsqueeze(-1)
    UW = torch.linalg.solve_triangular(beta.unsqueeze(-1) * Mk, rhs, upper=False, unitriangular=True)
    U, W = UW.split((v.shape[-1], k.shape[-1]), -1)
    G_C = G[:, :, -1:]
    return _Intra(A, U, W, q * eG, k * (G_C - G).to(q.dtype).exp(), eG[:, :, -1])


class _CheckpointPlan(NamedTuple):
    """Where the requested checkpoints fall: chunk id and in-chunk length ``j`` (1..C), flattened in sequence order,
    on the host (to select them per unit without a device read) and on the device (to gather with), and the slots
    they are written to."""

    cid: list[int]
    cid_t: Tensor
    j_t: Tensor
    slots_t: Tensor


def _plan_checkpoints(positions: Sequence[Sequence[int]] | None, slots: Sequence[Sequence[int]] | None,
                      cu: list[int], lay: _Layout, C: int, device: torch.device) -> _CheckpointPlan | None:
    """The plan of the requested checkpoints, None when there are none."""
    if positions is None and slots is None:
        return None
    _check_checkpoints(positions, slots, cu)
    cid, j = [], []
    for i, ps in enumerate(positions or ()):
        for p in ps:
            t = (p - 1) // C
            cid.append(lay.offs[t] + lay.rank[i])
            j.append(p - t * C)
    if not cid:
        return None
    flat_slots = [s for ss in slots or () for s in ss]
    return _CheckpointPlan(cid, torch.tensor(cid, dtype=torch.int64, device=device),
                           torch.tensor(j, dtype=torch.int64, device=device),
                           torch.tensor(flat_slots, dtype=torch.int64, device=device))


def _check_checkpoints(positions: Sequence[Sequence[int]] | None, slots: Sequence[Sequence[int]] | None,
                      cu: Sequence[int]) -> None:
    """Refuse (ValueError) checkpoint positions and slots that do not match the batch: one list of each per sequence,
    equal lengths, positions sorted within ``1..len`` of their sequence."""
    if positions is None or slots is None:
        raise ValueError("checkpoint_positions and checkpoint_slots go together")
    if len(positions) != len(cu) - 1 or len(slots) != len(cu) - 1:
        raise ValueError("checkpoint_positions and checkpoint_slots need one list per sequence")
    for i, (ps, ss) in enumerate(zip(positions, slots, strict=True)):
        if len(ps) != len(ss):
            raise ValueError(f"sequence {i}: {len(ps)} checkpoint positions but {len(ss)} checkpoint slots")
        previous, length = 1, cu[i + 1] - cu[i]
        for p in ps:
            if not previous <= p <= length:
                raise ValueError("checkpoint positions must be sorted and within 1..len of their sequence")
            previous = p


def _units(offs: list[int], g0: int, g1: int) -> Iterator[tuple[int, int, int]]:
    """``(step, lo, hi)``: the chunks ``lo:hi`` of each step inside the chunk group ``g0:g1``, in step order."""
    t = bisect.bisect_right(offs, g0) - 1
    while t < len(offs) - 1 and offs[t] < g1:
        yield t, max(offs[t], g0), min(offs[t + 1], g1)
        t += 1


def _checkpoints_in(
    out: Tensor,
    plan: _CheckpointPlan,
    lo: int,
    hi: int,
    G: Tensor,
    kc: Tensor,
    Vp: Tensor,
    S_in: Tensor,
) -> None:
    """Write into ``out`` the checkpoints inside chunks ``lo:hi``, whose entering states are ``S_in`` and
    pseudo-values ``Vp``: ``S_j = Diag(exp(G_j)) S_in + (K[:j] * exp(G_j - G[:j]))^T V'[:j]`` (spec §3.7, exact)."""
    picked = [k for k, c in enumerate(plan.cid) if lo <= c < hi]
    if not picked:
        return
    sel = torch.tensor(picked, device=G.device)
    c, jj = plan.cid_t[sel], plan.j_t[sel]
    rr = c - lo
    Gc = G[c]  # [P, H, C, K]
    Gj = Gc[torch.arange(len(picked), device=G.device), :, jj - 1]  # [P, H, K]
    keep = (torch.arange(G.shape[2], device=G.device) < jj.unsqueeze(1))[:, None, :, None]  # [P, 1, C, 1]
    kd = kc[c] * (Gj.unsqueeze(2) - Gc).masked_fill(~keep, -torch.inf).to(kc.dtype).exp()
    out[sel] = Gj.to(kc.dtype).exp().unsqueeze(-1) * S_in[rr] + kd.transpose(-1, -2) @ Vp[rr]


def kda_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    checkpoint_positions: Sequence[Sequence[int]] | None = None,
    checkpoint_slots: Sequence[Sequence[int]] | None = None,
    chunk_size: int = 64,
) -> Tensor:
    """Chunked KDA (spec §3.7) over a packed varlen batch, all sequences advancing together chunk by chunk.

    Args:
        q, k: ``[T, H, K]`` raw queries/keys (L2-normalised and q scaled by ``K**-0.5`` here), any float dtype.
        v: ``[T, H, V]``.
        g: ``[T, H, K]`` log-decay from ``kda_gate`` (must be ``<= 0``).
        beta: ``[T, H]``, already sigmoid-ed.
        state_pool: ``[S, H, K, V]`` fp32 state pool, per slot ``[H, K (key rows), V (value cols)]`` as transformers.
            Sequence ``i`` starts from ``state_pool[state_indices[i]]`` (the caller zeroes fresh slots) and its final
            state is written back there **in place**; other slots are untouched. Indices must be distinct.
        state_indices: ``[N]`` int64 slots.
        cu_seqlens: ``[N + 1]`` offsets, a host sequence or an int64 tensor; sequence ``i`` is rows
            ``cu_seqlens[i]:cu_seqlens[i + 1]`` (length 0 allowed).
        checkpoint_positions: per sequence a sorted list of positions ``1 <= p <= len_i`` (prefix-cache checkpoints,
            or the states after each draft token of a speculative verification); the state after the first ``p``
            tokens of that sequence in this call is written **in place** to ``state_pool[checkpoint_slots[i][n]]``
            (exact, at any position, not only chunk ends). None for none.
        checkpoint_slots: the slots those states go to, aligned with ``checkpoint_positions``; distinct from each
            other and from ``state_indices``.
        chunk_size: chunk length ``C``.

    Returns:
        ``[T, H, V]`` output in ``q``'s dtype. Math in fp32 (fp64 if ``q`` or the pool is fp64), the cumulative
        log-decays in fp64.
    """
    cdt = _compute_dtype(q, state_pool)
    C, (H, K), V = chunk_size, k.shape[1:], v.shape[-1]
    # Host offsets: a device tensor is read back once here (a sync on a GPU); callers that have them pass a list.
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    lay = _layout(cu, C, q.device)
    NC = lay.offs[-1]
    qn, kn = _qk_norm(q, k, cdt)
    qc, kc, vc, gc, bc = (_to_chunks(x.to(cdt), lay, C) for x in (qn, kn, v, g, beta))
    # fp64 cumulative log-decay: exponents are differences G_r - G_i of values that reach -C*|g| (-320 at the K3
    # bound); in fp32 their absolute error eps*|G| would be a relative error of every decay factor.
    G = gc.to(torch.float64).cumsum(2)
    slots = state_indices.to(device=q.device, dtype=torch.int64)[lay.order]
    S = state_pool.index_select(0, slots).to(cdt)  # [N, H, K, V] in rank order
    O = qc.new_empty(NC, H, C, V)  # every chunk is written by exactly one unit
    plan = _plan_checkpoints(checkpoint_positions, checkpoint_slots, cu, lay, C, q.device)
    cps = qc.new_zeros(len(plan.cid) if plan is not None else 0, H, K, V)  # states at the checkpoints
    group = max(1, _GROUP_ELEMS // (2 * H * C * max(C, K)))  # chunks per intra group
    # The intra-chunk part is state-independent: computed for a whole group of chunks at once; the state recurrence
    # then walks the group's chunks step by step (all live sequences of a step together).
    for g0 in range(0, NC, group):
        g1 = min(NC, g0 + group)
        it = _intra(qc[g0:g1], kc[g0:g1], vc[g0:g1], G[g0:g1], bc[g0:g1])
        for t, lo, hi in _units(lay.offs, g0, g1):
            r, s = slice(lo - g0, hi - g0), slice(lo - lay.offs[t], hi - lay.offs[t])  # intra rows, state rows
            S_in = S[s]
            Vp = it.U[r] - it.W[r] @ S_in  # pseudo-values
            O[lo:hi] = it.Qg[r] @ S_in + it.A[r] @ Vp
            if plan is not None:
                _checkpoints_in(cps, plan, lo, hi, G, kc, Vp, S_in)
            S[s] = it.decay[r].unsqueeze(-1) * S_in + it.Kd[r].transpose(-1, -2) @ Vp
    state_pool.index_copy_(0, slots, S.to(state_pool.dtype))
    if plan is not None:
        state_pool.index_copy_(0, plan.slots_t, cps.to(state_pool.dtype))
    out = O.transpose(1, 2).reshape(NC * C, H, V).index_select(0, lay.cid * C + lay.pos)  # back to packed tokens
    return out.to(q.dtype)
