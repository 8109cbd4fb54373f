"""Reference token-sampling ops: penalties, temperature, top-k/top-p/min-p masks, exponential-race sampling, token-wise
and block verification of speculative drafts, logprobs.

Pure PyTorch on ``[N, V]`` logits (row i = one sequence); every function is out of place and batched over rows,
except the per-row generator draws in :func:`random_sample` and :func:`block_rejection_sample` (one request's block).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def token_counts(token_ids: Tensor, cu_seqlens: Tensor, vocab_size: int) -> Tensor:
    """How often each vocabulary entry occurs in each of N packed token sequences.

    Args:
        token_ids: ``[T]`` int token ids; row i owns ``token_ids[cu_seqlens[i]:cu_seqlens[i+1]]``. Every id must be
            in ``[0, vocab_size)``.
        cu_seqlens: ``[N+1]`` int cumulative lengths, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``; empty rows
            are allowed.
        vocab_size: V.

    Returns:
        ``[N, V]`` int64 counts on ``token_ids.device`` (built with one ``scatter_add_``).
    """
    device = token_ids.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    num_rows = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]  # [N]
    row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths,
                                           output_size=token_ids.numel())  # [T]
    flat = row_of_token * vocab_size + token_ids.to(torch.long)  # [T]
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: Tensor,
    prompt_counts: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
) -> Tensor:
    """vLLM's repetition, presence and frequency penalties (in that order).

    A token seen in the prompt or the output has a positive logit divided by ``repetition_penalty`` and a
    non-positive one multiplied by it; then ``frequency_penalty * output count`` and ``presence_penalty`` (if the
    output contains it) are subtracted. Neutral values (1, 0, 0) leave a row bit-identical.

    Args:
        logits: ``[N, V]`` float; not modified.
        prompt_counts: ``[N, V]`` int or bool, non-zero where the token occurs in the prompt.
        output_counts: ``[N, V]`` int occurrences in the generated output (see :func:`token_counts`).
        repetition_penalty: ``[N]`` float, > 0.
        presence_penalty: ``[N]`` float.
        frequency_penalty: ``[N]`` float.

    Returns:
        ``[N, V]`` penalised logits, a new tensor in ``logits.dtype``.
    """
    dtype = logits.dtype
    seen = (prompt_counts != 0) | (output_counts != 0)  # [N, V]
    # Kept within the dtype's normal range: 1e-300 or 1e300 in fp32 would be 0 or inf, and 0 * -inf is NaN.
    finfo = torch.finfo(dtype)
    rep = torch.where(seen, repetition_penalty.to(dtype).clamp(finfo.tiny, finfo.max)[:, None], 1.0)  # [N, V]
    out = _keep_finite(logits, torch.where(logits > 0, logits / rep, logits * rep))
    out = out - frequency_penalty.to(dtype)[:, None] * output_counts.to(dtype)
    return out - presence_penalty.to(dtype)[:, None] * (output_counts != 0).to(dtype)


def _keep_finite(logits: Tensor, scaled: Tensor) -> Tensor:
    """``scaled`` with the entries that overflowed from a finite logit clamped to the dtype's range: a penalty like
    1e-300 or a temperature of 1e-5 must not turn a row into +inf (softmax NaN) or all -inf. Masked -inf stays."""
    limit = torch.finfo(scaled.dtype).max
    return torch.where(torch.isfinite(logits), scaled.clamp(-limit, limit), scaled)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Set to ``-inf`` every token a grammar disallows.

    Args:
        logits: ``[N, V]`` float; not modified.
        bitmask: ``[N, ceil(V / 32)]`` int32 (any device): bit ``j`` of word ``w`` set means token ``32 * w + j`` is
            allowed (the layout llguidance and xgrammar write); bits past V are ignored.

    Returns:
        ``[N, V]`` logits with disallowed tokens at ``-inf``, a new tensor.
    """
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(device=logits.device, dtype=torch.int32)[:, :, None] >> shifts) & 1  # [N, W, 32]
    allowed = bits.view(num_rows, -1)[:, :vocab_size].bool()  # [N, V]
    return logits.masked_fill(~allowed, float("-inf"))


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """``logits [N, V] / temperature [N]`` (every temperature > 0; greedy rows never get here), overflow clamped to the
    dtype's finite range. Out of place."""
    return _keep_finite(logits, logits / temperature.to(logits.dtype)[:, None])


def apply_top_k_top_p_min_p(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Set to ``-inf`` every token that top-k, min-p or top-p drops, with one sort for the whole batch.

    The order is vLLM v1's: min-p and top-k (both thresholds on the logit value, so they commute), then top-p on
    the distribution renormalised over the survivors. The most likely token always survives.

    Args:
        logits: ``[N, V]`` float (temperature already applied); not modified.
        top_k: ``[N]`` int; keep the tokens whose logit is >= the k-th largest (ties at the k-th value all stay,
            as in vLLM). ``<= 0`` or ``>= V`` disables it.
        top_p: ``[N]`` float in (0, 1]; keep the smallest set of most likely tokens whose probability reaches
            ``top_p``: a token is dropped when the tokens ranked strictly before it already hold ``>= top_p``
            (computed as vLLM does, from the tail). 1 disables it.
        min_p: ``[N]`` float in [0, 1]; drop tokens whose probability is ``< min_p * max probability``. 0 disables.

    Returns:
        ``[N, V]`` logits with dropped tokens at ``-inf``, a new tensor.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V] each
    k = top_k.to(device=device, dtype=torch.long)
    k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)  # [N]
    kth_value = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
    drop = sorted_logits < kth_value  # [N, V]
    probs = sorted_logits.softmax(dim=-1)
    drop |= probs < min_p.to(device=device, dtype=probs.dtype)[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # vLLM's form of "the mass ranked before the token reaches top_p": the mass from the token down to the least
    # likely one is <= 1 - top_p. Unlike a running sum from the top, it cannot drift past 1 and drop tail tokens
    # when top_p == 1.
    tail_mass = probs.flip(-1).cumsum(dim=-1).flip(-1)  # [N, V]
    drop = tail_mass <= 1 - top_p.to(device=device, dtype=probs.dtype)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sample(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Exponential race (Gumbel-max): row i's token is ``argmax(probs[i] / q)`` with ``q ~ Exp(1)`` of shape [V].

    A row with its own generator draws its ``q`` alone, so its token depends only on ``probs[i]`` and that
    generator's state (not on the batch or the row's position). Rows with ``None`` draw one batched ``q`` from
    torch's default generator of ``probs.device``.

    Args:
        probs: ``[N, V]`` float probabilities (rows need not be normalised; zeros are never picked while a row has
            a positive entry); not modified.
        generators: N entries; a generator must live on ``probs.device``. Each one advances by one [V] draw.

    Returns:
        ``[N]`` int64 token ids.
    """
    if len(generators) != probs.shape[0]:
        raise ValueError(f"need one generator entry per row: {len(generators)} for {probs.shape[0]} rows")
    q = torch.empty_like(probs)  # [N, V]
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        idx = torch.tensor(shared, device=probs.device)
        q.index_copy_(0, idx, torch.empty((len(shared), probs.shape[1]), dtype=probs.dtype,
                                          device=probs.device).exponential_())
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    # exponential_ may return exactly 0; a tiny floor keeps probs / q finite without changing any realistic race.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def rejection_sample(probs: Tensor, draft_probs: Tensor, draft_token_ids: Tensor,
                     generators: Sequence[torch.Generator | None]) -> Tensor:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) of one position per row.

    Row i accepts its draft token ``x`` (drawn from ``q = draft_probs[i]``) with probability ``min(1, p(x) / q(x))``
    for the target ``p = probs[i]``; otherwise it samples from ``max(p - q, 0)`` renormalised. The result is
    distributed exactly as ``p`` whatever ``q`` is. A row's uniform and its residual race come from its own generator
    (reproducible whatever the batch); unseeded rows draw batched from the default generator.

    Args:
        probs: ``[N, V]`` target probabilities after every logits processor (rows sum to 1); not modified.
        draft_probs: ``[N, V]`` the distributions the draft tokens were drawn from.
        draft_token_ids: ``[N]`` int64.
        generators: N entries on ``probs.device``; each advances by one uniform and one [V] exponential draw.

    Returns:
        ``[N]`` int64 token ids: the draft token where accepted, a residual sample elsewhere (never the draft token,
        whose residual is 0 when rejected).
    """
    num_rows = probs.shape[0]
    if draft_probs.shape != probs.shape or draft_token_ids.shape != (num_rows,) or len(generators) != num_rows:
        raise ValueError(f"rejection_sample: probs {tuple(probs.shape)}, draft_probs {tuple(draft_probs.shape)}, "
                         f"draft_token_ids {tuple(draft_token_ids.shape)} and {len(generators)} generators disagree")
    q = draft_probs.to(probs.dtype)
    u = torch.empty(num_rows, dtype=probs.dtype, device=probs.device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u.index_copy_(0, torch.tensor(shared, device=probs.device),
                      torch.rand(len(shared), dtype=probs.dtype, device=probs.device))
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=probs.dtype, device=probs.device, generator=g)[0]
    x = draft_token_ids.to(device=probs.device, dtype=torch.long)[:, None]
    p_x, q_x = probs.gather(1, x).squeeze(1), q.gather(1, x).squeeze(1)
    accept = u * q_x < p_x  # u < p/q without a division (q_x > 0 for a token drawn from q)
    residual = (probs - q).clamp_min(0)
    # p == q up to rounding leaves no residual mass: such a row accepts with probability ~1; sample p if it did not.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    return torch.where(accept, x.squeeze(1), random_sample(residual, generators))


def block_rejection_sample(target_probs: Tensor, draft_probs: Tensor, draft_token_ids: Tensor,
                           generator: torch.Generator | None) -> tuple[int, int]:
    """Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", Algorithm 2) of
    one request's n draft tokens: the block is accepted jointly rather than token by token.

    With ``P_j = target_probs[j - 1]`` (the target given the context and ``d_1..d_{j-1}``) and ``Q_j =
    draft_probs[j - 1]`` (the distribution ``d_j`` was drawn from; it may depend on the drafts before it or not):
    ``a_0 = 1``, ``a_i = min(a_{i-1} P_i(d_i) / Q_i(d_i), 1)``; the residual after i accepted drafts is ``r_i =
    max(a_i P_{i+1} - Q_{i+1}, 0)`` with mass ``R_i``; the weights are ``h_i = R_i / (R_i + 1 - a_i)`` for i < n
    (0 where that is 0 / 0) and ``h_n = a_n``. With ``eta_1..eta_n ~ U(0, 1)``, ``tau = max {i : eta_i < h_i}``
    (0 if none): the first tau drafts are accepted, and the token after them is drawn from ``P_{n+1}`` if tau == n,
    else from ``r_tau`` renormalised (``P_{tau+1}`` itself where ``r_tau`` has no mass, as `rejection_sample`
    does). (The paper walks i from n down and stops at the first pass: the same tau in distribution.)

    Guarantee: ``P(tau >= i | d_1..d_i) = a_i`` and, for i < n, ``P(tau == i | d_1..d_i) = R_i``, so the drafts
    accepted, the token after them and target sampling after that are distributed exactly as sampling from the
    target, whatever the drafts' distributions. The paper proves the expected tau optimal among such lossless
    verifiers, so never below token-wise `rejection_sample` (which this equals for n == 1). A draft with
    ``Q_i(d_i) == 0`` passes through ``a_i`` without a division (``a_i = 1`` if ``a_{i-1} P_i(d_i) > 0``, else 0).

    Args:
        target_probs: ``[n + 1, V]`` the target's final sampling distributions at positions 0..n (after every logits
            processor; rows sum to 1); not modified.
        draft_probs: ``[n, V]`` the distributions the drafts were drawn from (any device; moved to the target's).
        draft_token_ids: ``[n]`` int, the drafts. n == 0 samples ``target_probs[0]``.
        generator: the request's generator on ``target_probs.device``, or None (torch's default one of that
            device). It advances by one draw of n uniforms (none if n == 0), then one [V] exponential race
            (`random_sample`), all in float64; the computation is in float64 too.

    Returns:
        ``(tau, token_id)``: the number of drafts accepted, in 0..n, and the token that follows them.
    """
    num_drafts = draft_token_ids.numel()
    if (target_probs.ndim != 2 or target_probs.shape[0] != num_drafts + 1 or draft_token_ids.shape != (num_drafts,)
            or draft_probs.shape != (num_drafts, target_probs.shape[1])):
        raise ValueError(f"block_rejection_sample: target_probs {tuple(target_probs.shape)}, draft_probs "
                         f"{tuple(draft_probs.shape)} and draft_token_ids {tuple(draft_token_ids.shape)} disagree")
    weights, final = _block_verification(target_probs, draft_probs, draft_token_ids)
    device = target_probs.device
    tau = torch.zeros((), dtype=torch.long, device=device)
    if num_drafts:
        eta = torch.rand(num_drafts, dtype=torch.float64, device=device, generator=generator)
        lengths = torch.arange(1, num_drafts + 1, device=device)  # [n]
        tau = torch.where(eta < weights, lengths, 0).amax()
    token = random_sample(final.index_select(0, tau.view(1)), [generator])  # [1]
    accepted, token_id = torch.stack((tau, token[0])).tolist()  # the one host sync
    return accepted, token_id


def _block_verification(target_probs: Tensor, draft_probs: Tensor, draft_token_ids: Tensor) -> tuple[Tensor, Tensor]:
    """`block_rejection_sample`'s decision, in float64 on the target's device: ``(weights [n], final [n + 1, V])``
    with ``weights[i - 1] = h_i`` and ``final[i]`` the unnormalised distribution of the token after i accepted
    drafts (the residual ``r_i``, or ``P_{i+1}`` where it has no mass; ``final[n] = P_{n+1}``)."""
    p = target_probs.to(torch.float64)  # [n + 1, V]
    q = draft_probs.to(device=p.device, dtype=torch.float64)  # [n, V]
    num_drafts = q.shape[0]
    x = draft_token_ids.to(device=p.device, dtype=torch.long)[:, None]
    p_x, q_x = p[:num_drafts].gather(1, x).squeeze(1), q.gather(1, x).squeeze(1)  # [n] each
    survival = [torch.ones((), dtype=torch.float64, device=p.device)]  # a_0..a_n
    for i in range(num_drafts):
        kept = survival[-1] * p_x[i]
        # kept >= q_x covers q_x == 0 < kept (a draft the draft "could not" draw); kept == 0 rejects it outright.
        ratio = torch.where(kept >= q_x[i], 1.0, kept / q_x[i].clamp_min(torch.finfo(torch.float64).tiny))
        survival.append(torch.where(kept > 0, ratio, 0.0))
    a = torch.stack(survival)  # [n + 1]
    residual = (a[:num_drafts, None] * p[:num_drafts] - q).clamp_min(0)  # [n, V]: r_0..r_{n-1}
    mass = residual.sum(dim=-1)  # [n]
    final = torch.cat((torch.where(mass[:, None] > 0, residual, p[:num_drafts]), p[num_drafts:]))
    if num_drafts == 0:
        return a[:0], final
    # R_i + 1 - a_i == 0 only where a_i == 1 and R_i == 0: then tau == i has probability 0 whatever h_i is.
    denominator = mass[1:] + (1 - a[1:num_drafts])  # [n - 1]
    inner = torch.where(denominator > 0, mass[1:] / denominator.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return torch.cat((inner, a[num_drafts:])), final


def compute_logprobs(logits: Tensor) -> Tensor:
    """``log_softmax`` over the vocabulary in fp32: ``[N, V]`` -> ``[N, V]`` float32. Out of place."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def gather_logprobs(logprobs: Tensor, token_ids: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sampled tokens' logprobs and ranks, and the ``num_top`` most likely tokens of each row.

    Args:
        logprobs: ``[N, V]`` from :func:`compute_logprobs`.
        token_ids: ``[N]`` int sampled token per row.
        num_top: how many alternatives to return, ``0 <= num_top <= V``.

    Returns:
        ``(top_ids [N, num_top] int64, top_logprobs [N, num_top], token_logprobs [N], ranks [N] int64)``: the top
        list best first; ``rank = 1 + number of tokens with a strictly higher logprob``.
    """
    token_logprobs = logprobs.gather(1, token_ids.to(torch.long)[:, None])  # [N, 1]
    ranks = 1 + (logprobs > token_logprobs).sum(dim=-1)  # [N]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1, sorted=True)  # [N, num_top] each
    return top_ids, top_logprobs, token_logprobs.squeeze(1), ranks
