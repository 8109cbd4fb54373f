"""What every layer needs to know about one flattened step, and the per-layer cache tensors it reads and writes.

Passed explicitly down the forward call (no global context). Built by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardBatch:
    """One step over N sequences holding T new tokens in total: decode rows, then verify chunks, then prefill chunks.

    Sequence i owns the new-token rows `cu_seqlens[i]:cu_seqlens[i+1]`; sequences `[0, num_decodes)` have exactly one
    new token each (so they are also rows `[0, num_decodes)`); the next `num_verifies` sequences are speculative
    verify chunks (a sampled token and its proposals), which every layer runs with the decode math, token after token
    (`kda_verify`, `short_conv_verify`; MLA as decode rows), so a verified token gets exactly the numbers plain decoding
    would give it; the rest are prefill chunks.
    """

    cu_seqlens: torch.Tensor
    """[N + 1] int64 offsets of each sequence's new tokens."""
    cu_seqlens_host: tuple[int, ...]
    """The same offsets on the host, for ops that plan on the CPU (a device read is a stream sync on a GPU)."""
    context_lens: torch.Tensor
    """[N] int64 tokens per sequence after this step (already cached + new)."""
    context_lens_host: tuple[int, ...] = ()
    """The same on the host (empty where the builder did not give them)."""
    num_decodes: int
    state_indices: torch.Tensor
    """[N] int64 KDA state slot of each sequence (a fresh sequence's slot is zeroed by the caller)."""
    block_tables: torch.Tensor
    """[N, max_blocks] int64 MLA KV blocks of each sequence (padding entries: any valid block id)."""
    slot_mapping: torch.Tensor
    """[T] int64 flat KV cache row (block_id * block_size + offset) of each new token."""
    decode_slot_range: slice | None = None
    """`slice(a, a + num_decodes)` when the decode rows' state slots are `a, a + 1, ...` in row order (the common
    case: slots are handed out lowest first): their state is then updated in place, with no gather or scatter."""
    num_verifies: int = 0
    verify_scratch_slots: tuple[tuple[int, ...], ...] = ()
    """Per verify sequence: the state slots that receive the KDA state (recurrent state and conv window) after each
    of its first tokens (the scratch states of a speculative step, one per proposed token)."""
    verify_rows: torch.Tensor | None = None
    """[R] int64, per verify token: its sequence index (for the MLA block table). None without verify chunks."""
    verify_context_lens: torch.Tensor | None = None
    """[R] int64, per verify token: the tokens it attends to (cached ones, then the chunk's up to itself)."""
    checkpoint_positions: tuple[tuple[int, ...], ...] | None = None
    """Per prefill sequence (index i - num_decodes - num_verifies), positions within this step's tokens after which
    the KDA state (recurrent state and conv window) is saved: prefix-cache checkpoints. None for none."""
    checkpoint_slots: tuple[tuple[int, ...], ...] | None = None
    """The state slots those checkpoints are written to, aligned with `checkpoint_positions`."""
    embed_rows: torch.Tensor | None = None
    """[n] int64 token rows whose input embeddings are `embed_values` instead of their token's (image
    placeholders; None: every row embeds its token)."""
    embed_values: torch.Tensor | None = None
    """[n, hidden] the embeddings of `embed_rows` (projected image features)."""

    @property
    def num_decode_like(self) -> int:
        """Sequences run with the decode math: decode rows and verify chunks."""
        return self.num_decodes + self.num_verifies

    @property
    def num_decode_rows(self) -> int:
        """Token rows of those sequences (they come first)."""
        return self.cu_seqlens_host[self.num_decode_like]

    def prefill_cu_seqlens(self) -> torch.Tensor:
        """[P + 1] offsets of the prefill sequences, relative to the first prefill row."""
        cu = self.cu_seqlens[self.num_decode_like :]
        return cu - cu[0]

    def prefill_cu_seqlens_host(self) -> list[int]:
        """`prefill_cu_seqlens` on the host."""
        cu = self.cu_seqlens_host[self.num_decode_like :]
        return [x - cu[0] for x in cu]

    def verify_cu_seqlens_host(self) -> list[int]:
        """Offsets of the verify chunks' rows on the host, relative to the first verify row."""
        cu = self.cu_seqlens_host[self.num_decodes:self.num_decode_like + 1]
        return [x - cu[0] for x in cu]


@dataclass(frozen=True, slots=True)
class KDALayerCache:
    """Device tensors of one KDA layer."""

    state: torch.Tensor
    """[num_slots, H, Dk, Dv] fp32 recurrent states."""
    conv: torch.Tensor
    """[num_slots, 3 * H * Dh, K - 1] pre-conv windows of q, k, v."""


@dataclass(frozen=True, slots=True)
class MLALayerCache:
    """Device tensors of one MLA layer."""

    kv: torch.Tensor
    """[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] latent rows."""


LayerCache = KDALayerCache | MLALayerCache
