"""The waiting queue: FCFS by arrival, or by (priority, arrival)."""

from __future__ import annotations

import heapq

from deltaserve.request import Request


class WaitingQueue:
    """A heap keyed by (priority, arrival) for 'priority', by arrival alone for 'fcfs'.

    Preempted requests keep their arrival index, so they go back ahead of later arrivals.
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple[int, int, Request]] = []

    def _key(self, r: Request) -> tuple[int, int, Request]:
        return (r.priority if self.policy == "priority" else 0, r.arrival_index, r)

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, self._key(request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request_id: str) -> Request | None:
        for i, (_, _, r) in enumerate(self._heap):
            if r.request_id == request_id:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return r
        return None

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
