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
  prefix cache then holds). A key may be held by several replicas; a lookup hashes every full block of the new
  prompt, takes the longest recorded key and, of the live replicas that hold it, the least loaded.

Affinity yields to load, in proportion to what it saves: the affine replica gets the request unless it has more
requests in flight than the least loaded one by more than its allowance, one request per `tokens_per_request`
matched tokens (at most `max_imbalance`; a session id counts as `max_imbalance`). So a short shared prefix (a
system prompt) does not pin every new session to one replica: once the request goes to the least loaded replica,
that one holds the prefix too and later sessions spread over both; a conversation's own history, long and held
by one replica only, keeps it there. Both maps are LRU-bounded; `forget` drops every entry of a replica (its
engine process died: its cache is gone).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

__all__ = ["Router"]

MAX_ENTRIES = 65_536
"""Prefix keys kept (least recently used dropped first); as many session ids again."""
MAX_IMBALANCE = 16
"""Requests in flight an affine replica may have beyond the least loaded one and still get the request, at most."""
TOKENS_PER_REQUEST = 256
"""Matched prefix tokens that are worth one more request in flight on the affine replica."""


class Router:
    """Picks a replica per request; see the module docstring. `loads[i]` is replica i's requests in flight, None
    while it is dead."""

    def __init__(self, num_replicas: int, *, block_size: int, session_affinity: bool = True,
                 max_entries: int = MAX_ENTRIES, max_imbalance: int = MAX_IMBALANCE,
                 tokens_per_request: int = TOKENS_PER_REQUEST) -> None:
        if num_replicas < 1 or block_size < 1:
            raise ValueError(f"a router needs >= 1 replica and block_size >= 1, got {num_replicas}, {block_size}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.session_affinity = session_affinity
        self.max_entries = max_entries
        self.max_imbalance = max_imbalance
        self.tokens_per_request = tokens_per_request
        self._prefixes: collections.OrderedDict[int, set[int]] = collections.OrderedDict()
        """Chained block hash -> the replicas that hold that prefix, oldest use first."""
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
            if affine is not None and (loads[affine[0]] or 0) - (loads[least] or 0) <= affine[1]:
                chosen = affine[0]
        if chosen == least:
            self._next = (least + 1) % self.num_replicas
        if self.session_affinity:
            if session_id is not None:
                _put(self._sessions, session_id, chosen, self.max_entries)
            for position in _recorded_positions(len(keys)):
                self._hold(keys[position - 1], chosen)
        return chosen

    def finished(self, token_ids: Sequence[int], replica: int) -> None:
        """A request on `replica` finished with prompt + output `token_ids`: that prefix is in its cache now."""
        if self.session_affinity and len(token_ids) >= self.block_size:
            self._hold(self.block_keys(token_ids)[-1], replica)

    def forget(self, replica: int) -> int:
        """Drop every session and prefix entry that points at `replica`; how many were dropped."""
        stale_prefixes = [key for key, holders in self._prefixes.items() if replica in holders]
        stale_sessions = [key for key, owner in self._sessions.items() if owner == replica]
        for prefix in stale_prefixes:
            holders = self._prefixes[prefix]
            holders.discard(replica)
            if not holders:
                del self._prefixes[prefix]
        for session in stale_sessions:
            del self._sessions[session]
        return len(stale_prefixes) + len(stale_sessions)

    def clear(self) -> None:
        """Forget every entry (the replicas' prefix caches were reset)."""
        self._prefixes.clear()
        self._sessions.clear()

    def owners(self) -> collections.Counter[int]:
        """Entries (sessions and prefixes held) per replica, for tests."""
        held = [replica for holders in self._prefixes.values() for replica in holders]
        return collections.Counter([*held, *self._sessions.values()])

    # -- internals -------------------------------------------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int]) -> list[int]:
        """keys[k - 1] is the chained hash of the first k full blocks of `token_ids`."""
        keys, key, size = [], 0, self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            key = hash((key, tuple(token_ids[start:start + size])))
            keys.append(key)
        return keys

    def _affine(self, keys: list[int], session_id: str | None, loads: Sequence[int | None]
                ) -> tuple[int, int] | None:
        """The live replica that holds the session, else the least loaded live one that holds the longest recorded
        prefix, and how many requests of imbalance that is worth; None if no live replica holds either."""
        if session_id is not None:
            owner = self._sessions.get(session_id)
            if owner is not None and loads[owner] is not None:
                return owner, self.max_imbalance
        for blocks in range(len(keys), 0, -1):
            holders = [r for r in self._prefixes.get(keys[blocks - 1], ()) if loads[r] is not None]
            if holders:
                self._prefixes.move_to_end(keys[blocks - 1])
                allowance = min(self.max_imbalance, blocks * self.block_size // self.tokens_per_request)
                return min(holders, key=lambda r: (loads[r] or 0, r)), allowance
        return None

    def _hold(self, key: int, replica: int) -> None:
        holders = self._prefixes.get(key)
        _put(self._prefixes, key, {replica} if holders is None else holders | {replica}, self.max_entries)

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


def _put(table: collections.OrderedDict, key: object, value: object, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
