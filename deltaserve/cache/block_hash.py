"""Chained block hashes: a block's hash covers its tokens and, through its parent, every token before it."""

from __future__ import annotations

import random
from collections.abc import Sequence

# A per-process random root, so hashes cannot be predicted or collided on purpose from outside.
ROOT_HASH = random.SystemRandom().getrandbits(62)


def chain_hashes(token_ids: Sequence[int], block_size: int, *, start: int = 0, parent: int = ROOT_HASH,
                 extra_keys: tuple = ()) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block `start` on; `parent` is the hash before block `start`.

    `extra_keys` (for example image hashes or a cache salt) enter the first hashed block.
    """
    out = []
    for b in range(start, len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[b * block_size : (b + 1) * block_size]), extra_keys if b == 0 else ()))
        out.append(parent)
    return out


def parent_hash(hashes: Sequence[int], num_blocks: int) -> int:
    """The hash of the chain of the first `num_blocks` blocks (the root for zero)."""
    return hashes[num_blocks - 1] if num_blocks else ROOT_HASH
