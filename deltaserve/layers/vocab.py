"""Vocabulary parallelism: each tensor-parallel rank holds a contiguous share of the embedding table's rows (and of
the LM head's), padded so that every rank holds the same number."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.distributed import ParallelGroup, Shard
from deltaserve.ops.linear import linear


class VocabShard:
    """Rank `tp.rank`'s rows `[start, start + valid)` of a `[vocab_size, d]` table, stored in `rows` rows (the tail
    past `valid` is zero padding on the last ranks when `tp.size` does not divide the vocabulary)."""

    def __init__(self, vocab_size: int, tp: ParallelGroup) -> None:
        self.vocab_size, self.tp = vocab_size, tp
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.valid = max(0, min(self.rows, vocab_size - self.start))

    def target(self, table: torch.Tensor) -> torch.Tensor | Shard:
        """The checkpoint target of the local table (its padding zeroed here, never loaded)."""
        if self.tp.size == 1:
            return table
        with torch.no_grad():
            table[self.valid:].zero_()
        return Shard(table[:self.valid], 0, self.start, self.vocab_size)

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `ids` [T] -> [T, d]: each rank looks up the ids it holds, zeros for the others, and the
        ranks' rows are summed (exactly one rank contributes each row)."""
        if self.tp.size == 1:
            return F.embedding(ids, table)
        local = ids - self.start
        foreign = (local < 0) | (local >= self.valid)
        h = F.embedding(local.masked_fill(foreign, 0), table)
        h.masked_fill_(foreign[:, None], 0.0)
        return self.tp.all_reduce(h)

    def logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """hidden [n, d] -> fp32 logits [n, vocab_size]: each rank's columns, gathered in rank order."""
        local = linear(hidden, head).float()
        if self.tp.size == 1:
            return local
        return self.tp.all_gather(local, dim=-1)[:, :self.vocab_size]
