"""`Router`: which data-parallel replica serves a request (no asyncio, no torch; `DPEngineClient` owns one).

Two policies (`ParallelConfig.load_balance_method`):

- 'least_loaded': the live replica with the fewest requests in flight; ties rotate, so a sequential client is
  spread over the replicas too.
- 'session_affinity' (the default): a request goes back to the replica that holds its cache, else to the least
  loaded. Its cache is found by, first, a client-given session id (the `X-Session-ID` header, OpenAI's `user`,
  Anthropic's `metadata.user_id`), then the longest prefix of its prompt, in whole blocks of `block_size` token
  ids, that an earlier request was sent with or produced. Prefixes are keyed by a chained hash of their blocks
  (hash of (previous key, the block's ids)); a request records its prompt's keys at the powers-of-two block counts
  and at its last full block when routed (so the next turn of a chat, which extends the prompt, or a request that
  shares a long system prompt, finds it), and the key of its prompt + output when it finishes (what the replica's
  prefix cache then holds). A lookup hashes every full block of the new prompt and takes the longest recorded key.

Affinity yields to load: a replica with more than `max_imbalance` requests in flight beyond the least loaded one
does not get the request (a popular system prompt must not pin every session to one replica); the request then
goes to the least loaded replica and its keys point there from now on. Both maps are LRU-bounded; `forget`
drops every entry of a replica (its engine process died: its cache is gone).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

__all__ = ["Router"]

MAX_ENTRIES = 65_536
"""Prefix keys kept (least recently used dropped first); as many session ids again."""
MAX_IMBALANCE = 16
"""Requests in flight an affine replica may have beyond the least loaded one and still get the request."""


class Router:
    """Picks a replica per request; see the module docstring. `loads[i]` is replica i's requests in flight, None
    while it is dead."""

    def __init__(self, num_replicas: int, *, block_size: int, session_affinity: bool = True,
                 max_entries: int = MAX_ENTRIES, max_imbalance: int = MAX_IMBALANCE) -> None:
        if num_replicas < 1 or block_size < 1:
            raise ValueError(f"a router needs >= 1 replica and block_size >= 1, got {num_replicas}, {block_size}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.session_affinity = session_affinity
        self.max_entries = max_entries
        self.max_imbalance = max_imbalance
        self._prefixes: collections.OrderedDict[int, int] = collections.OrderedDict()
        """Chained block hash -> replica, oldest use first."""
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Session id -> replica, oldest use first."""
        self._next = 0
        """Where the search for a least-loaded replica starts (rotates on ties)."""

    # -- routing ---------------------------------------------------------------------------------------------------

    def route(self, prompt_ids: Sequence[int], loads: Sequence[int | None], session_id: str | None = None) -> int:
        """The replica for a new request, recorded as the owner of its session and prompt prefixes. ValueError
        when every replica is dead."""
        least = self._least_loaded(loads)
        chosen = least
        keys = self.block_keys(prompt_ids) if self.session_affinity else []
        if self.session_affinity:
            affine = self._affine(keys, session_id, loads)
            if affine is not None and (loads[affine] or 0) - (loads[least] or 0) <= self.max_imbalance:
                chosen = affine
        if chosen == least:
            self._next = (least + 1) % self.num_replicas
        if self.session_affinity:
            if session_id is not None:
                _put(self._sessions, session_id, chosen, self.max_entries)
            for position in _recorded_positions(len(keys)):
                _put(self._prefixes, keys[position - 1], chosen, self.max_entries)
        return chosen

    def finished(self, token_ids: Sequence[int], replica: int) -> None:
        """A request on `replica` finished with prompt + output `token_ids`: that prefix is in its cache now."""
        if self.session_affinity and len(token_ids) >= self.block_size:
            keys = self.block_keys(token_ids)
            _put(self._prefixes, keys[-1], replica, self.max_entries)

    def forget(self, replica: int) -> int:
        """Drop every session and prefix entry that points at `replica`; how many were dropped."""
        stale_prefixes = [key for key, owner in self._prefixes.items() if owner == replica]
        stale_sessions = [key for key, owner in self._sessions.items() if owner == replica]
        for prefix in stale_prefixes:
            del self._prefixes[prefix]
        for session in stale_sessions:
            del self._sessions[session]
        return len(stale_prefixes) + len(stale_sessions)

    def clear(self) -> None:
        """Forget every entry (the replicas' prefix caches were reset)."""
        self._prefixes.clear()
        self._sessions.clear()

    def owners(self) -> collections.Counter[int]:
        """Entries (sessions and prefixes) per replica, for tests and the status page."""
        return collections.Counter([*self._prefixes.values(), *self._sessions.values()])

    # -- internals -------------------------------------------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int]) -> list[int]:
        """keys[k - 1] is the chained hash of the first k full blocks of `token_ids`."""
        keys, key, size = [], 0, self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            key = hash((key, tuple(token_ids[start:start + size])))
            keys.append(key)
        return keys

    def _affine(self, keys: list[int], session_id: str | None, loads: Sequence[int | None]) -> int | None:
        """The live replica that holds the session, else the longest recorded prefix; None if none does."""
        if session_id is not None:
            owner = self._sessions.get(session_id)
            if owner is not None and loads[owner] is not None:
                return owner
        for key in reversed(keys):
            owner = self._prefixes.get(key)
            if owner is not None and loads[owner] is not None:
                self._prefixes.move_to_end(key)
                return owner
        return None

    def _least_loaded(self, loads: Sequence[int | None]) -> int:
        best: int | None = None
        for offset in range(self.num_replicas):
            i = (self._next + offset) % self.num_replicas
            load = loads[i]
            if load is not None and (best is None or load < (loads[best] or 0)):
                best = i
        if best is None:
            raise ValueError("every data-parallel replica is dead")
        return best


def _recorded_positions(num_blocks: int) -> list[int]:
    """Block counts whose key a routed prompt records: 1, 2, 4, ... and its last full block."""
    positions, p = [], 1
    while p < num_blocks:
        positions.append(p)
        p *= 2
    if num_blocks:
        positions.append(num_blocks)
    return positions


def _put(table: collections.OrderedDict, key: object, value: int, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
