"""`EngineStats`: a snapshot of the engine for metrics (no torch, so the API process can import it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.kvstore.store import KVStoreStats


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """Queue lengths and pool usage now, and cumulative counters since the engine started.

    "Used" blocks and slots are those held by live requests: cached blocks and state checkpoints that no request
    holds are evictable on demand and count as free, so both are 0 once every request has ended.
    """

    num_running: int
    """Requests holding cache memory (admitted, not finished)."""
    num_waiting: int
    """Requests queued for admission (new or preempted)."""
    kv_blocks_used: int
    kv_blocks_total: int
    state_slots_used: int
    """Running KDA state slots held by requests (checkpoint slots are not counted)."""
    state_slots_total: int
    prefix_queried_tokens: int
    """Prompt tokens looked up in the prefix cache (cumulative)."""
    prefix_hit_tokens: int
    """Prompt tokens served from the prefix cache (cumulative)."""
    num_preemptions: int
    """Times a running request lost its cache and went back to the queue (cumulative)."""
    steps: int
    """Engine steps run (cumulative)."""
    step_seconds: float = 0.0
    """Wall time inside `EngineCore.step` (cumulative)."""
    forward_seconds: float = 0.0
    """Of which the model forward (cumulative)."""
    prompt_tokens: int = 0
    """Prompt tokens of accepted requests (cumulative). Counted by the client loop that drives the `EngineCore`
    (`core_proc`, or `InprocEngineClient`); 0 from `EngineCore.get_stats` itself."""
    generation_tokens: int = 0
    """Tokens generated (cumulative). Counted like `prompt_tokens`."""
    spec_num_drafts: int = 0
    """Speculative decoding: request-steps that verified at least one proposed token (cumulative)."""
    spec_num_draft_tokens: int = 0
    """Proposed tokens verified (cumulative)."""
    spec_num_accepted_tokens: int = 0
    """Proposed tokens accepted (cumulative)."""
    spec_accepted_per_pos: tuple[int, ...] = ()
    """Index j: drafts whose proposed token j was accepted (cumulative)."""
    spec_adaptive_steps: int = 0
    """Adaptive verification: steps it decided (cumulative; 0 without it)."""
    spec_adaptive_offered_positions: int = 0
    """Draft positions the block drafter offered it (cumulative)."""
    spec_adaptive_verified_positions: int = 0
    """Draft positions it kept for verification (cumulative): the rest were cut as not worth their cost."""
    spec_adaptive_draft_off_steps: int = 0
    """Steps after which it turned drafting off (speculation could not win at that load; cumulative)."""
    host_hit_tokens: int = 0
    """Prompt tokens of prefix hits that needed the host tier (cumulative; also in `prefix_hit_tokens`)."""
    host_demoted_bytes: int = 0
    """Bytes copied from the device caches to the host tier, per rank (cumulative)."""
    host_promoted_bytes: int = 0
    """Bytes copied from the host tier back to the device, per rank (cumulative)."""
    host_copy_seconds: float = 0.0
    """Time rank 0 spent on those copies (cumulative)."""
    shared_fetched: int = 0
    """Entries (blocks, states) fetched from the shared store into the host tier (cumulative)."""
    shared_fetch_failures: int = 0
    """Fetches from the shared store that failed on some rank: a miss, corrupt, or the store down (cumulative)."""
    shared_gets: int = 0
    """Rank 0's shared-store gets that reached the store (cumulative; the rest of this group likewise)."""
    shared_get_hits: int = 0
    """Gets that returned a whole, checked entry."""
    shared_get_bytes: int = 0
    """Payload bytes those gets returned."""
    shared_get_seconds: float = 0.0
    """Time in gets (their mean latency: this over `shared_gets`)."""
    shared_puts: int = 0
    """Entries written (write-through of every registered block and block-boundary state)."""
    shared_put_bytes: int = 0
    shared_put_seconds: float = 0.0
    shared_errors: int = 0
    """Store calls that failed or ran past the timeout (the request recomputes)."""
    shared_corrupt: int = 0
    """Entries refused as truncated, altered or another namespace's (deleted from the store)."""
    kv_transfer_sent: int = 0
    """Disaggregation, prefill side: request caches published for decode instances (cumulative)."""
    kv_transfer_sent_kv_bytes: int = 0
    """Bytes of KV blocks published, all ranks (cumulative)."""
    kv_transfer_sent_state_bytes: int = 0
    """Bytes of KDA state (recurrent state and conv window) published, all ranks (cumulative)."""
    kv_transfer_received: int = 0
    """Decode side: request caches fetched whole from prefill instances (cumulative)."""
    kv_transfer_received_kv_bytes: int = 0
    kv_transfer_received_state_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    """Time rank 0 spent packing and publishing, or fetching and checking, transfers (cumulative)."""
    kv_transfer_failures: int = 0
    """Fetches that failed (peer gone, timeout, a payload cut short or corrupt): recomputed locally (cumulative)."""
    kv_transfer_fallbacks: int = 0
    """Requests with kv_transfer_params computed locally without a fetch: the local cache held the prefix, the host
    tier had no room, or the transfer was for another prompt (cumulative)."""
    images_encoded: int = 0
    """Images the vision tower ran on (cumulative)."""
    encoder_cache_hits: int = 0
    """Image lookups the encoder cache answered, one per image per step that computes some of its placeholders
    (cumulative); lookups are this plus `images_encoded`."""
    encoder_seconds: float = 0.0
    """Time in the vision tower and projector (cumulative)."""


def shared_store_stats(store: KVStoreStats | None, lookups: KVStoreStats | None = None) -> dict[str, Any]:
    """The `EngineStats.shared_*` store-level fields from a store's counters (all 0 without a store): rank 0's
    reads and writes (`store`), and the errors of the engine core's own client (`lookups`: the existence checks
    before admission, the first calls to fail when the store dies)."""
    out: dict[str, Any] = {}
    if store is not None:
        out = {"shared_gets": store.get_calls, "shared_get_hits": store.hits, "shared_get_bytes": store.hit_bytes,
               "shared_get_seconds": store.get_latency_s_sum, "shared_puts": store.puts,
               "shared_put_bytes": store.put_bytes, "shared_put_seconds": store.put_latency_s_sum,
               "shared_errors": store.errors, "shared_corrupt": store.corrupt}
    if lookups is not None:
        out["shared_errors"] = out.get("shared_errors", 0) + lookups.errors
    return out
