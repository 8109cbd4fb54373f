"""Block tables sent to worker processes as what changed since the last step.

A request's block list grows by one id per `block_size` tokens but is O(context) long: at 1M tokens, 65,536 ids,
which pickled and unpickled for every step cost ~5 ms per rank. The executor's `BlockTableSender` therefore sends,
per chunk, only the ids appended since the list it last sent for that request, and each worker's
`BlockTableReceiver` appends them to its copy (vLLM's scheduler sends `new_block_ids` for the same reason). A
`BlockList`'s epoch changes whenever ids are dropped or replaced, so a list whose epoch differs from the one last sent
(a preempted and readmitted request, a speculative rollback that freed blocks, a new request) is sent whole.
Both sides forget a request when it appears in `finished_request_ids`. Every rank decodes every step in order, so the
two sides agree; a receiver that finds otherwise raises instead of computing on a wrong table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deltaserve.cache.block_pool import BlockList
from deltaserve.scheduler.output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class BlockTail:
    """The ids of a request's block list from position `start` on, for the list of epoch `epoch`."""

    epoch: int
    start: int
    """Ids the receiver already holds for this epoch (0: the whole list is here)."""
    ids: list[int]


@dataclass(frozen=True, slots=True)
class BlockDeltaStep:
    """A `SchedulerOutput` whose chunks' block lists travel as `tails` (their `block_ids` are left empty)."""

    out: SchedulerOutput
    tails: dict[str, BlockTail]


class BlockTableSender:
    """The executor's side: remembers, per request, the epoch and length of the block list it last sent."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}

    def encode(self, out: SchedulerOutput) -> BlockDeltaStep:
        """`out` with each chunk's `BlockList` replaced by the ids the receiver lacks."""
        for rid in out.finished_request_ids:
            self._sent.pop(rid, None)
        tails: dict[str, BlockTail] = {}
        chunks = []
        for chunk in out.chunks:
            ids = chunk.block_ids
            if isinstance(ids, BlockList):
                epoch, have = self._sent.get(chunk.request_id, (None, 0))
                start = have if epoch == ids.epoch and have <= len(ids) else 0
                tails[chunk.request_id] = BlockTail(ids.epoch, start, ids[start:])
                self._sent[chunk.request_id] = (ids.epoch, len(ids))
                chunk = dataclasses.replace(chunk, block_ids=[])
            chunks.append(chunk)
        return BlockDeltaStep(dataclasses.replace(out, chunks=chunks), tails)

    @property
    def num_tracked(self) -> int:
        """Requests whose last sent list is remembered."""
        return len(self._sent)


class BlockTableReceiver:
    """A worker's side: each request's block list, rebuilt from the tails it is sent."""

    def __init__(self) -> None:
        self._rows: dict[str, BlockList] = {}

    def decode(self, step: BlockDeltaStep | SchedulerOutput) -> SchedulerOutput:
        """The scheduler output `step` was encoded from (a plain `SchedulerOutput` is returned as it is: the
        in-process executor sends no deltas). The chunks' lists are this receiver's copies, which later steps
        extend in place: a step uses them while it runs only."""
        if isinstance(step, SchedulerOutput):
            return step
        out = step.out
        for rid in out.finished_request_ids:
            self._rows.pop(rid, None)
        chunks = []
        for chunk in out.chunks:
            tail = step.tails.get(chunk.request_id)
            if tail is not None:
                chunk = dataclasses.replace(chunk, block_ids=self._apply(chunk.request_id, tail))
            chunks.append(chunk)
        return dataclasses.replace(out, chunks=chunks)

    def _apply(self, request_id: str, tail: BlockTail) -> BlockList:
        if tail.start == 0:
            fresh = BlockList(tail.ids)
            fresh.epoch = tail.epoch
            self._rows[request_id] = fresh
            return fresh
        row = self._rows.get(request_id)
        if row is None or row.epoch != tail.epoch or len(row) != tail.start:
            held = "nothing" if row is None else f"epoch {row.epoch}, {len(row)} ids"
            raise RuntimeError(f"block table of request {request_id!r} out of sync: sent ids from {tail.start} of "
                               f"epoch {tail.epoch}, this worker holds {held}")
        row.extend(tail.ids)
        return row

    @property
    def num_tracked(self) -> int:
        """Requests whose block list this receiver holds."""
        return len(self._rows)
