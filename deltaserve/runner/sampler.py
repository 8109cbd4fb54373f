"""Token selection for one batch of logits, with vLLM v1 semantics: min_tokens stop masking, grammar bitmasks,
penalties, greedy or temperature/top-k/min-p/top-p sampling with per-request generators, and logprobs of the raw
logits.

The tensor work lives in `deltaserve.ops.sampling`; this module turns per-row `SamplingParams` into batched tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from deltaserve.ops import sampling as sampling_ops
from deltaserve.outputs import TokenLogprobs
from deltaserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingRow:
    """Everything the sampler needs about one logits row (one sequence). Built by the runner per step."""

    params: SamplingParams
    """The request's decoding settings."""
    generator: torch.Generator | None
    """The request's own generator (seeded requests), on the logits' device; advanced by one [V] draw per sampled
    (non-greedy) step. None: the row draws from torch's default generator of that device, batched with the other
    unseeded rows."""
    prompt_token_ids: Sequence[int]
    """Prompt tokens (repetition penalty). Read only when the params have a penalty."""
    output_token_ids: Sequence[int]
    """Tokens this sequence generated so far (penalties, min_tokens)."""
    stop_token_ids: frozenset[int]
    """EOS and stop token ids: masked to -inf while ``len(output_token_ids) < params.min_tokens``."""


@dataclass(frozen=True, slots=True)
class TokenBitmask:
    """The grammar-allowed tokens of some rows (structured output); the other rows are not touched."""

    row_indices: list[int]
    """Logits rows constrained, in the order of the bitmask's rows."""
    bitmask: torch.Tensor
    """``[len(row_indices), ceil(V / 32)]`` int32: bit j of word w set = token 32 * w + j allowed."""


@dataclass(frozen=True, slots=True)
class DraftToken:
    """A proposed token drawn from a known distribution, for the row that verifies it (speculative decoding)."""

    token_id: int
    probs: torch.Tensor
    """``[V]`` the draft distribution the token was drawn from."""


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One sampled token per row, in row order."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """None for rows whose ``params.logprobs`` is None."""


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], token_bitmask: TokenBitmask | None = None,
           drafts: Sequence[DraftToken | None] | None = None) -> SamplerOutput:
    """Pick one token per row.

    Order (vLLM v1): every token outside ``allowed_token_ids``, the completing token of each ``bad_words``
    sequence, and stop tokens for rows below ``min_tokens`` masked (a row this would leave empty keeps its stop
    tokens);
    the grammar bitmask of constrained rows (should the masks and the grammar leave a row nothing, the grammar
    applies without the min_tokens mask, then alone); ``logit_bias``; repetition, frequency and presence penalties;
    greedy rows (temperature below 1e-5) take the argmax; the others divide by their temperature, apply min-p and
    top-k, then top-p, and sample by exponential race. A seeded row's token depends only on its own logits row and
    generator. A non-greedy row with a draft token verifies it by rejection sampling against those final
    probabilities (`ops.sampling.rejection_sample`): the draft token when accepted, a residual sample otherwise, so
    the token is distributed as plain sampling's. (A greedy row takes the argmax: the draft is accepted iff equal.)
    `sampling_probs` returns the distributions drawn from.

    Args:
        logits: ``[N, V]`` fp32; row i belongs to ``rows[i]``. Not modified.
        rows: N sampling rows.
        token_bitmask: the grammar-allowed tokens of the constrained rows, or None (no cost for the others).
        drafts: per row, the draft token it verifies with its draft distribution, or None (plain sampling).

    Returns:
        The N token ids and, per row, its logprobs (computed from the raw ``logits``) or None.
    """
    token_ids, random_rows, probs = _final_distributions(logits, rows, token_bitmask)
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sampled = _sample_random(probs, [rows[i] for i in random_rows],
                                 [drafts[i] for i in random_rows] if drafts is not None else None)
        token_ids.index_copy_(0, idx, sampled)
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=token_logprobs(logits, token_ids, rows))


def sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow], token_bitmask: TokenBitmask | None = None
                   ) -> torch.Tensor:
    """The distribution `sample` draws each row's token from: its logits through every mask and processor, in
    `sample`'s order and with its fallbacks (allowed_token_ids, bad_words, min_tokens, the grammar bitmask,
    logit_bias, penalties, then temperature, min-p, top-k and top-p, softmax). A greedy row's is one-hot at its
    argmax. What speculative verification compares draft distributions with (`ops.sampling.block_rejection_sample`).

    Args:
        logits: ``[N, V]`` fp32; row i belongs to ``rows[i]``. Not modified.
        rows: N sampling rows (generators are not used).
        token_bitmask: the grammar-allowed tokens of the constrained rows, or None.

    Returns:
        ``[N, V]`` fp32 probabilities, each row summing to 1.
    """
    token_ids, random_rows, probs = _final_distributions(logits, rows, token_bitmask)
    out = torch.zeros_like(logits).scatter_(1, token_ids[:, None], 1.0)
    if random_rows:
        out.index_copy_(0, torch.tensor(random_rows, device=logits.device), probs)
    return out


def _final_distributions(logits: torch.Tensor, rows: Sequence[SamplingRow], token_bitmask: TokenBitmask | None
                         ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The processing chain shared by `sample` and `sampling_probs`: ``(argmax [N] of the processed logits, the
    indices of the non-greedy rows, their probabilities [M, V])``."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [N, V] with N = len(rows) = {len(rows)}, got {tuple(logits.shape)}")
    raw = logits
    restricted = _ban_bad_words(_mask_disallowed(logits, rows), rows)
    logits = _mask_stop_tokens(restricted, rows)
    if token_bitmask is not None and token_bitmask.row_indices:
        logits = _apply_token_bitmask((restricted, raw), logits, token_bitmask)
    logits = _apply_logit_bias(logits, rows)
    logits = _apply_penalties(logits, rows)
    token_ids = logits.argmax(dim=-1)  # [N]
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not random_rows:
        return token_ids, random_rows, logits[:0]
    idx = torch.tensor(random_rows, device=logits.device)
    return token_ids, random_rows, _random_probs(logits.index_select(0, idx), [rows[i] for i in random_rows])


def _mask_stop_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    vocab_size = logits.shape[1]
    pairs = [
        (i, token)
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens
        for token in row.stop_token_ids
        if 0 <= token < vocab_size
    ]
    if not pairs:
        return logits
    masked = _mask_pairs(logits, pairs)
    # A row left with nothing (allowed_token_ids are all stop tokens) keeps its stop tokens, or it would sample from
    # an all -inf row (id 0). The request still does not end before min_tokens. Selected on the device: no sync.
    empty = torch.isneginf(masked.amax(dim=-1, keepdim=True))  # [N, 1]
    return torch.where(empty, logits, masked)


def _mask_disallowed(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf for every token outside a row's allowed_token_ids (rows without the setting untouched)."""
    restricted = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not restricted:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    keep = torch.zeros(len(restricted), vocab_size, dtype=torch.bool)
    for k, i in enumerate(restricted):
        keep[k, _allowed_index(rows[i].params.allowed_token_ids, vocab_size)] = True
    idx = torch.tensor(restricted, device=device)
    masked = logits.index_select(0, idx).masked_fill(~keep.to(device), float("-inf"))
    return logits.index_copy(0, idx, masked)


@functools.lru_cache(maxsize=32)  # keeps its keys alive: up to a vocabulary of ints each
def _allowed_index(allowed_token_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """The in-vocabulary ids of an allowed_token_ids tuple, built once per request rather than every step."""
    return torch.tensor([t for t in allowed_token_ids if t < vocab_size], dtype=torch.long)


def _ban_bad_words(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """vLLM's bad_words: -inf for the last token of every bad sequence whose other tokens end the output."""
    vocab_size = logits.shape[1]
    pairs = [(i, word[-1]) for i, row in enumerate(rows) for word in row.params.bad_words_token_ids
             if word[-1] < vocab_size and _ends_with(row.output_token_ids, word[:-1])]
    return _mask_pairs(logits, pairs) if pairs else logits


def _mask_pairs(logits: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """A copy of `logits` with -inf at each (row, token) pair."""
    row_idx, token_idx = torch.tensor(pairs, device=logits.device).T
    return logits.index_put((row_idx, token_idx), torch.tensor(float("-inf"), dtype=logits.dtype,
                                                               device=logits.device))


def _ends_with(tokens: Sequence[int], tail: Sequence[int]) -> bool:
    return not tail or (len(tokens) >= len(tail) and list(tokens[-len(tail):]) == list(tail))


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """OpenAI's logit_bias: each (token, bias) pair of a row added to that row's logit (ids past the vocabulary
    ignored, as stop_token_ids are)."""
    vocab_size = logits.shape[1]
    entries = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.params.logit_bias
               if token < vocab_size]
    if not entries:
        return logits
    row_idx, token_idx, bias = zip(*entries, strict=True)
    device = logits.device
    return logits.index_put((torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device)),
                            torch.tensor(bias, dtype=logits.dtype, device=device), accumulate=True)


def _apply_token_bitmask(fallbacks: Sequence[torch.Tensor], logits: torch.Tensor, mask: TokenBitmask
                         ) -> torch.Tensor:
    """The grammar's mask on the constrained rows. A row it leaves empty takes the grammar on the first of
    `fallbacks` (logits with fewer masks: without min_tokens', then raw) that keeps some token."""
    idx = torch.tensor(mask.row_indices, device=logits.device)
    bitmask = mask.bitmask.to(logits.device)
    masked = sampling_ops.apply_token_bitmask(logits.index_select(0, idx), bitmask)  # [R, V]
    for fallback in fallbacks:
        empty = torch.isneginf(masked.amax(dim=-1))  # [R]: the masks left the grammar nothing
        if not bool(empty.any()):
            break
        relaxed = sampling_ops.apply_token_bitmask(fallback.index_select(0, idx), bitmask)
        masked = torch.where(empty[:, None], relaxed, masked)
    return logits.index_copy(0, idx, masked)


def _counts(seqs: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    cu_seqlens = torch.tensor([0, *accumulate(len(s) for s in seqs)], dtype=torch.long)
    return sampling_ops.token_counts(flat.to(device), cu_seqlens.to(device), vocab_size)  # [n, V]


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    sub = [rows[i] for i in penalised]
    idx = torch.tensor(penalised, device=device)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in sub], dtype=torch.float32, device=device)

    out = sampling_ops.apply_penalties(
        logits.index_select(0, idx),
        _counts([r.prompt_token_ids for r in sub], vocab_size, device),
        _counts([r.output_token_ids for r in sub], vocab_size, device),
        per_row("repetition_penalty"),
        per_row("presence_penalty"),
        per_row("frequency_penalty"),
    )
    return logits.index_copy(0, idx, out)


def _needs_filter(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size or params.top_p < 1.0 or params.min_p > 0.0


def _random_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits [M, V]`` (penalised, non-greedy rows only) -> ``[M, V]`` the probabilities they sample from."""
    device, vocab_size = logits.device, logits.shape[1]
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device)
    logits = sampling_ops.apply_temperature(logits, temperature)
    # Only rows with a filter go through the sort, so an unfiltered row's probabilities never depend on its batch.
    filtered = [i for i, r in enumerate(rows) if _needs_filter(r.params, vocab_size)]
    if filtered:
        idx = torch.tensor(filtered, device=device)
        params = [rows[i].params for i in filtered]
        masked = sampling_ops.apply_top_k_top_p_min_p(
            logits.index_select(0, idx),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        )
        logits = logits.index_copy(0, idx, masked)
    return logits.softmax(dim=-1)


def _sample_random(probs: torch.Tensor, rows: Sequence[SamplingRow],
                   drafts: Sequence[DraftToken | None] | None = None) -> torch.Tensor:
    """``probs [M, V]`` (`_random_probs`) -> ``[M]`` sampled (or draft-verified) token ids."""
    device = probs.device
    verified = [i for i, d in enumerate(drafts or ()) if d is not None]
    if not verified:
        return sampling_ops.random_sample(probs, [r.generator for r in rows])
    plain = [i for i in range(len(rows)) if drafts is None or drafts[i] is None]
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    if plain:
        idx = torch.tensor(plain, device=device)
        tokens.index_copy_(0, idx, sampling_ops.random_sample(probs.index_select(0, idx),
                                                              [rows[i].generator for i in plain]))
    assert drafts is not None
    picked = [d for d in drafts if d is not None]
    idx = torch.tensor(verified, device=device)
    tokens.index_copy_(0, idx, sampling_ops.rejection_sample(
        probs.index_select(0, idx), torch.stack([d.probs for d in picked]).to(device),
        torch.tensor([d.token_id for d in picked], device=device), [rows[i].generator for i in verified]))
    return tokens


def token_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
                   ) -> list[TokenLogprobs | None]:
    """Per row, the logprob, rank and top ``params.logprobs`` alternatives of ``token_ids [N]`` under the ``raw
    [N, V]`` logits (before any processor, as vLLM returns them); None for rows whose ``params.logprobs`` is None."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = {i: n for i, row in enumerate(rows) if (n := row.params.logprobs) is not None}
    if not wanted:
        return out
    idx = torch.tensor(list(wanted), device=raw.device)
    num_top = min(max(wanted.values()), raw.shape[1])
    top_ids, top_logprobs, token_logprobs, ranks = sampling_ops.gather_logprobs(
        sampling_ops.compute_logprobs(raw.index_select(0, idx)), token_ids.index_select(0, idx), num_top
    )
    ids, top_ids_l, top_lp_l = token_ids.tolist(), top_ids.tolist(), top_logprobs.tolist()
    for j, ((i, n), logprob, rank) in enumerate(zip(wanted.items(), token_logprobs.tolist(), ranks.tolist(),
                                                    strict=True)):
        out[i] = TokenLogprobs(token_id=ids[i], logprob=logprob, rank=rank,
                               top=tuple(zip(top_ids_l[j][:n], top_lp_l[j][:n], strict=True)))
    return out
