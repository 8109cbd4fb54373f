"""CPU backend of the chunked KDA prefill: the reference's chunked form (spec §3.7) with the decayed scores of a chunk
as one matmul ``(q exp(G)) (k exp(-G))^T`` where the cumulative log-decays allow it (else the reference's recursive
form), every decay a running product of per-token ``exp(g)`` in fp32, the chunk layout built by the elementwise ops
that are needed anyway, and fused per-step ops."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deltaserve.ops.kda import ref

CHUNK = 16
"""Internal chunk length (the caller's ``chunk_size`` is a reference setting; results match at any chunk size)."""

SPAN_LIMIT = 120.0
"""Widest in-chunk decay span ``-G_C`` (natural log units) whose decayed scores are factorised. The factors are taken
about the middle of the span, ``exp(G_r + span/2) * exp(-G_i - span/2)``, each within ``exp(+-60)``: far from fp32
overflow, and a product flushed to zero at ``exp(-60)`` drops under ``1e-38 * exp(60) ~ 1e-12`` of a score. A group
of chunks with a wider (chunk, head) pair, or with one ``g < _G_MIN``, takes the reference's recursive scores."""

_G_MIN = -80.0
"""Smallest per-token log-decay whose factor ``exp(g)`` the running product takes (fp32's normal range ends at -87)."""

_GROUP_ELEMS = 1 << 19
"""Elements of a ``[chunks, H, C, K]`` buffer per group of chunks: bounds memory on long prompts, and keeps a group's
buffers within a core's L2."""

_STATE_BYTES = 1 << 21
"""Bytes of states a batch of short sequences keeps (about half of a core's L2 on the machine measured): a chunk step
reads and writes every live state several times."""

_ALONE_CHUNKS = 8
"""Sequences of at least this many chunks run alone: their whole chunks are then views of the inputs (no padded copy;
a partial last chunk runs after them, padded) and the per-step calls are amortised over enough tokens."""

_DTYPES = (torch.float32, torch.bfloat16)


def supports(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, *args: object,
             **kwargs: object) -> bool:
    """CPU calls with fp32 / bf16 activations and an fp32 state pool (fp64 runs go to the reference)."""
    return (q.device.type == "cpu" and state_pool.dtype == torch.float32
            and all(t.dtype in _DTYPES for t in (q, k, v)) and g.dtype == torch.float32)


class _Workspace:
    """The large per-group buffers, allocated once per call for the largest group and reused by every group (fresh
    multi-megabyte allocations page-fault on every call)."""

    def __init__(self, B: int, C: int, H: int, K: int) -> None:
        self.E = torch.empty(B, C, H, K)
        self.Kinv = torch.empty(B, H, C, K)
        self.QK = torch.empty(B, H, 2 * C, K)
        self._recursive: tuple[Tensor, ...] | None = None

    def recursive(self) -> tuple[Tensor, ...]:
        """Buffers of the recursive scores, made on first use: q, k, exp(g) as ``[B, H, C, K]``, then the row
        factors, column factors and right-half rows of one level as ``[B, H, C / 2, K]``."""
        if self._recursive is None:
            B, H, C, K = self.Kinv.shape
            self._recursive = (*torch.empty(3, B, H, C, K), *torch.empty(3, B, H, C // 2, K))
        return self._recursive


class _Chunks:
    """The reference's per-chunk quantities (`ref._Intra`) of a group of chunks, each ``[B, H, C, *]``, with raw
    (unnormalised) queries: ``A`` and ``QK``'s q rows are linear in q, so its norm scales the output rows instead.
    Views of the workspace: valid until the next group."""

    def __init__(self, qc: Tensor, kc: Tensor, gc: Tensor, bc: Tensor, ws: _Workspace) -> None:
        """Args: token-major chunks ``[B, C, H, *]`` (zero padding rows): raw q, normalised k, log-decay g, beta."""
        B, C, H, K = kc.shape
        self.t = lambda x: x.permute(0, 2, 1, 3)  # [B, C, H, *] <-> [B, H, C, *] view
        span = -gc.sum(1)  # [B, H, K]
        self.ws, self.E, self.Kinv, self.QK = ws, ws.E[:B], ws.Kinv[:B], ws.QK[:B]
        eg = torch.exp(gc, out=self.Kinv.view(B, C, H, K))  # Kinv's buffer, free once eg is used
        # Factorised when every (chunk, head) of the group allows it (one host read per group); else the reference's
        # recursive form for the whole group.
        if span.max().item() <= SPAN_LIMIT and gc.min().item() >= _G_MIN:
            A, Mk = self._factorised(qc, kc, span, eg)
        else:
            A, Mk = self._recursive(qc, kc, eg)
        self.A = A.tril()  # [B, H, C, C] decayed q.k, i <= r
        # Tb = (I + L)^-1 diag(beta) with L = beta_r * Mk strictly below the diagonal (solve_triangular ignores the
        # rest): the reference's U - W S is Tb (v - k exp(G) S), applied per step (a [C, C] matmul).
        bt = self.t(bc.unsqueeze(-1))  # [B, H, C, 1]
        eye = torch.eye(C).expand(B, H, C, C)
        self.Tb = torch.linalg.solve_triangular(bt * Mk, eye, upper=False, unitriangular=True)
        self.Tb.mul_(bt.transpose(-1, -2))

    def _factorised(self, qc: Tensor, kc: Tensor, span: Tensor, eg: Tensor) -> tuple[Tensor, Tensor]:
        """Decayed scores as one matmul; sets ``QK`` (q exp(G), then k exp(G)), ``decay`` and ``Kd``."""
        C, t, E, Kinv, QK = qc.shape[1], self.t, self.E, self.Kinv, self.QK
        # E_r = exp(G_r + span/2) as a running product of the per-token factors exp(g) (each exact to an fp32
        # rounding, so E_r / E_i = exp(G_r - G_i) to about |r - i| roundings, however large |G|); es = exp(span/2).
        es = (span * 0.5).exp_()
        torch.mul(eg[:, 0], es, out=E[:, 0])
        for r in range(1, C):
            torch.mul(E[:, r - 1], eg[:, r], out=E[:, r])
        # Rows q E then k E of one buffer: one matmul with k / E gives the decayed q.k and k.k scores.
        torch.mul(t(qc), t(E), out=QK[:, :, :C])
        torch.mul(t(kc), t(E), out=QK[:, :, C:])
        torch.div(t(kc), t(E), out=Kinv)
        scores = torch.bmm(QK.flatten(0, 1), Kinv.flatten(0, 1).transpose(1, 2)).view(*Kinv.shape[:2], 2 * C, C)
        inv_es = t(es.reciprocal_().unsqueeze(1))  # [B, H, 1, K]
        QK.mul_(inv_es)  # k E and q E were k exp(G) * es and q exp(G) * es
        self.decay = E[:, -1] * inv_es[:, :, 0]  # [B, H, K] exp(G_C)
        self.Kd = Kinv.mul_(t(E[:, -1:]))  # [B, H, C, K] k exp(G_C - G)
        return scores[:, :, :C], scores[:, :, C:]

    def _recursive(self, qc: Tensor, kc: Tensor, eg: Tensor) -> tuple[Tensor, Tensor]:
        """The reference's recursive decayed scores (safe at any decay), with its exp(G_r - G_p) and exp(G_p - G_i)
        as running products of exp(g) over at most the chunk; ``QK``, ``decay`` and ``Kd`` the same way. Every
        factor is <= 1, so an underflow only drops a value below 1e-38."""
        B, C, H, K = qc.shape
        t, E, Kinv, QK = self.t, self.E, self.Kinv, self.QK
        E[:, 0] = eg[:, 0]
        for r in range(1, C):
            torch.mul(E[:, r - 1], eg[:, r], out=E[:, r])  # exp(G_r)
        torch.mul(t(qc), t(E), out=QK[:, :, :C])
        torch.mul(t(kc), t(E), out=QK[:, :, C:])
        self.decay = E[:, -1].clone()  # [B, H, K] exp(G_C)
        q, k, egh, F, Bc, R = (x[:B] for x in self.ws.recursive())
        egh.copy_(t(eg))
        E[:, -1] = 1.0  # E becomes exp(G_C - G_i), a running product from the chunk's end
        for r in range(C - 2, -1, -1):
            torch.mul(E[:, r + 1], eg[:, r + 1], out=E[:, r])
        self.Kd = torch.mul(t(kc), t(E), out=Kinv)  # overwrites eg (copied above)
        q.copy_(t(qc))
        k.copy_(t(kc))
        A, Mk = q.new_zeros(B, H, C, C), q.new_zeros(B, H, C, C)
        # As `ref._decayed_scores` for a power-of-two C: in a block [s, s + 2h), rows r of the right half meet the
        # columns i of the left half through p = s + h - 1: exp(G_r - G_p) is the product of exp(g) over the right
        # half up to r, exp(G_p - G_i) over the left half after i.
        h = C // 2
        while h >= 1:
            nb = C // (2 * h)
            e = egh.unflatten(2, (nb, 2, h))  # [B, H, nb, 2, h, K]
            rows, cols, right = (x.view(B, H, nb, h, K) for x in (F, Bc, R))
            rows.copy_(e[:, :, :, 1])
            cols[:, :, :, h - 1] = 1.0
            for j in range(1, h):
                rows[:, :, :, j].mul_(rows[:, :, :, j - 1])
                torch.mul(cols[:, :, :, h - j], e[:, :, :, 0, h - j], out=cols[:, :, :, h - j - 1])
            left = cols.mul_(k.unflatten(2, (nb, 2, h))[:, :, :, 0]).transpose(-1, -2)  # [B, H, nb, K, h]
            for x, M in ((q, A), (k, Mk)):
                torch.mul(x.unflatten(2, (nb, 2, h))[:, :, :, 1], rows, out=right)
                blocks = M.unflatten(2, (nb, 2, h)).unflatten(-1, (nb, 2, h)).diagonal(dim1=2, dim2=5)[:, :, 1, :, 0]
                blocks.copy_((right @ left).permute(0, 1, 3, 4, 2))
            h //= 2
        for x, M in ((q, A), (k, Mk)):  # x_r . k_r on the diagonal (exp(0)): a [C, C] matmul beats a mul and sum
            M.diagonal(dim1=-2, dim2=-1).copy_((x @ k.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1))
        return A, Mk


def _token_chunks(x: Tensor, lay: ref._Layout, C: int, identity: bool) -> Tensor:
    """``[T, H, *]`` packed tokens -> ``[chunks, C, H, *]`` token-major chunks, zero-padded (a view when the tokens
    already are one sequence of whole chunks)."""
    NC = lay.offs[-1]
    if identity:
        return x.view(NC, C, *x.shape[1:])
    return x.new_zeros(NC * C, *x.shape[1:]).index_copy_(0, lay.cid * C + lay.pos, x).view(NC, C, *x.shape[1:])


def _runs(cu: list[int], per_batch: int) -> list[tuple[int, int]]:
    """Sequence ranges ``[a, b)`` run together: a long sequence alone, consecutive short ones up to ``per_batch``."""
    runs, a = [], 0
    for i in range(len(cu) - 1):
        if cu[i + 1] - cu[i] >= _ALONE_CHUNKS * CHUNK:
            runs += [(a, i)] if a < i else []
            runs.append((i, i + 1))
            a = i + 1
        elif i + 1 - a >= per_batch:
            runs.append((a, i + 1))
            a = i + 1
    return runs + ([(a, len(cu) - 1)] if a < len(cu) - 1 else [])


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
    """Same contract as :func:`deltaserve.ops.kda.ref.kda_prefill` (packed varlen batch, state pool read and written
    in place, checkpoint states at any positions into their slots), for CPU fp32 / bf16 activations and an fp32
    pool; math in fp32. ``chunk_size`` is ignored: chunks are `CHUNK` long."""
    del chunk_size
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    if checkpoint_positions is not None or checkpoint_slots is not None:
        ref._check_checkpoints(checkpoint_positions, checkpoint_slots, cu)
    (H, K), V = k.shape[1:], v.shape[-1]
    out = q.new_empty(cu[-1], H, V)
    runs = _runs(cu, max(1, _STATE_BYTES // (state_pool[0].numel() * state_pool.element_size())))
    most = max((-(-(cu[b] - cu[a]) // CHUNK) + b - a for a, b in runs), default=0)  # chunks of a run, at most
    ws = _Workspace(max(1, min(most, _GROUP_ELEMS // (H * CHUNK * K))), CHUNK, H, K)
    for a, b in runs:
        positions = None if checkpoint_positions is None else checkpoint_positions[a:b]
        ckpt_slots = None if checkpoint_slots is None else checkpoint_slots[a:b]
        lo, hi = cu[a], cu[b]
        whole = lo + (hi - lo) // CHUNK * CHUNK
        if b - a > 1 or whole in (lo, hi):
            _prefill(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state_pool, state_indices[a:b],
                     [c - lo for c in cu[a : b + 1]], positions, ckpt_slots, out[lo:hi], ws)
            continue
        # One sequence with a partial last chunk: its whole chunks on views of the inputs, then the tail (padded),
        # which starts from the state the first part leaves in the slot.
        ckpts = list(zip(positions[0], ckpt_slots[0], strict=True)) if positions and ckpt_slots else []
        for r0, r1 in ((lo, whole), (whole, hi)):
            part = [(p - (r0 - lo), slot) for p, slot in ckpts if r0 - lo < p <= r1 - lo]  # rebased to the part
            _prefill(q[r0:r1], k[r0:r1], v[r0:r1], g[r0:r1], beta[r0:r1], state_pool, state_indices[a:b],
                     [0, r1 - r0], [[p for p, _ in part]] if part else None, [[s for _, s in part]] if part else None,
                     out[r0:r1], ws)
    return out


def _prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, state_indices: Tensor,
             cu: list[int], checkpoint_positions: Sequence[Sequence[int]] | None,
             checkpoint_slots: Sequence[Sequence[int]] | None, out: Tensor, ws: _Workspace) -> None:
    """`kda_prefill` of one run of sequences (``cu``: host offsets from 0) into ``out`` ``[T, H, V]``."""
    C, (H, K), V = CHUNK, k.shape[1:], v.shape[-1]
    lay = ref._layout(cu, C, q.device)
    NC, T = lay.offs[-1], cu[-1]
    # L2 norms as in the reference (eps inside the sqrt, q scaled by K**-0.5): k is normalised here, q's factor
    # scales the output rows.
    norm = lambda x: (torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).square_() + 1e-6).rsqrt_()  # noqa: E731
    nq = norm(q).mul_(K**-0.5)  # [T, H]
    kn = k * norm(k).unsqueeze(-1)  # [T, H, K] fp32
    identity = len(cu) == 2 and T == NC * C  # one sequence of whole chunks: chunks are views
    qc, kc, vc, gc, bc, nqc = (_token_chunks(x, lay, C, identity)
                               for x in (q, kn, v, g, beta.to(torch.float32), nq))
    oc = out.view(NC, C, H, V) if identity else out.new_empty(NC, C, H, V)  # [chunks, C, H, V] output rows
    slots = state_indices.to(device=q.device, dtype=torch.int64)[lay.order]
    S = state_pool.index_select(0, slots)  # [N, H, K, V] in rank order
    plan = ref._plan_checkpoints(checkpoint_positions, checkpoint_slots, cu, lay, C, q.device)
    cps = torch.zeros(len(plan.cid) if plan is not None else 0, H, K, V)  # states at the checkpoints
    group = ws.E.shape[0]
    for g0 in range(0, NC, group):
        g1 = min(NC, g0 + group)
        ch = _Chunks(qc[g0:g1], kc[g0:g1], gc[g0:g1], bc[g0:g1], ws)
        for t, lo, hi in ref._units(lay.offs, g0, g1):
            r, s = slice(lo - g0, hi - g0), slice(lo - lay.offs[t], hi - lay.offs[t])  # chunk rows, state rows
            S_in = S[s]
            Sf = S_in.flatten(0, 1)  # [n * H, K, V]; matmul operands below flattened the same way
            P = torch.bmm(ch.QK[r].flatten(0, 1), Sf)  # [n * H, 2C, V]: q exp(G) S, then k exp(G) S
            X = P[:, C:].view(hi - lo, H, C, V)
            torch.sub(vc[lo:hi].transpose(1, 2), X, out=X)  # v - k S, in place
            Vp = torch.bmm(ch.Tb[r].flatten(0, 1), X.flatten(0, 1))  # pseudo-values (the reference's U - W S)
            # Out of place: an in-place baddbmm_ on the strided q rows of P runs one addmm per head.
            o = torch.baddbmm(P[:, :C], ch.A[r].flatten(0, 1), Vp)
            torch.mul(o.view(hi - lo, H, C, V).transpose(1, 2), nqc[lo:hi].unsqueeze(-1), out=oc[lo:hi])
            if plan is not None:
                _checkpoints(cps, plan, lo, hi, lo - g0, gc[g0:g1], kc[g0:g1], Vp.view(hi - lo, H, C, V), S_in)
            S_in.mul_(ch.decay[r].unsqueeze(-1))
            Sf.baddbmm_(ch.Kd[r].flatten(0, 1).transpose(1, 2), Vp)
    state_pool.index_copy_(0, slots, S)
    if plan is not None:
        state_pool.index_copy_(0, plan.slots_t, cps)
    if not identity:
        torch.index_select(oc.view(NC * C, H, V), 0, lay.cid * C + lay.pos, out=out)


def _checkpoints(out: Tensor, plan: ref._CheckpointPlan, lo: int, hi: int, row0: int, gc: Tensor, kc: Tensor,
                 Vp: Tensor, S_in: Tensor) -> None:
    """Write into ``out`` the checkpoints inside chunks ``lo:hi`` (group rows from ``row0``) with the reference's
    exact form, on those chunks' own fp64 cumulative log-decays."""
    picked = [n for n, c in enumerate(plan.cid) if lo <= c < hi]
    if not picked:
        return
    sel = torch.tensor(picked, device=out.device)
    rows = plan.cid_t[sel] - lo  # unit rows
    G = gc[rows + row0].to(torch.float64).cumsum(1).transpose(1, 2)  # [P, H, C, K]
    P = len(picked)
    mini = ref._CheckpointPlan(list(range(P)), torch.arange(P, device=out.device), plan.j_t[sel], plan.slots_t[sel])
    states = out.new_empty(P, *out.shape[1:])
    ref._checkpoints_in(states, mini, 0, P, G, kc[rows + row0].transpose(1, 2), Vp[rows], S_in[rows])
    out[sel] = states
