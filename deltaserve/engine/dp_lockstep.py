"""`Lockstep`: data-parallel replicas whose routed experts form one group step together.

Each forward of such a replica exchanges tokens with every other replica in every MoE layer
(`distributed/replica_experts.py`), so a replica must run a step whenever any replica runs one: a real step, or one
with nothing scheduled, whose workers join the exchanges with no tokens. Before each step the replicas' engine
processes agree, in one all-reduce over a gloo group of their own (vLLM's DP coordination group), whether any of
them has work and whether any is shutting down. An engine that knows every replica idle waits for its inputs at
most `IDLE_SYNC_S` before asking again, which bounds the delay a new request on another replica waits for it.
"""

from __future__ import annotations

import datetime
import logging
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from deltaserve.config.dp_experts import ExpertReplicas

logger = logging.getLogger(__name__)

IDLE_SYNC_S = 0.01
"""How long an engine waits for inputs while every replica is idle before the replicas agree again."""
TIMEOUT_S = 120.0
"""How long an engine waits for the others to join, or to agree: a replica that hangs is an error, not a hang (one
that dies is one at once: its connection closes)."""


class Lockstep:
    """This engine process's place in the replicas' agreement group (joined at construction)."""

    def __init__(self, replicas: ExpertReplicas) -> None:
        address = urlsplit(replicas.engines_address)
        if address.scheme != "tcp" or address.hostname is None or address.port is None:
            raise ValueError(f"engines_address={replicas.engines_address!r}: expected 'tcp://HOST:PORT'")
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        try:
            store = dist.TCPStore(address.hostname, address.port, replicas.size, is_master=replicas.rank == 0,
                                  timeout=timeout)
            self._group = dist.ProcessGroupGloo(dist.PrefixStore("lockstep", store), replicas.rank, replicas.size,
                                                timeout)
        except Exception as e:
            raise RuntimeError(f"replica {replicas.rank}/{replicas.size} could not join the lockstep group at "
                               f"{replicas.engines_address}: {e}") from e
        self._store = store  # kept alive: rank 0's store serves the others
        self.idle_wait_s = IDLE_SYNC_S
        self.busy_anywhere = False
        """Whether the last agreement found work on some replica (then no engine waits for inputs)."""
        logger.info("replica %d of %d: steps in lockstep with the others (experts span the replicas)",
                    replicas.rank, replicas.size)

    def agree(self, busy: bool, stopping: bool) -> tuple[bool, bool]:
        """(some replica is busy, some replica is shutting down), from every replica's own two flags."""
        flags = torch.tensor([int(busy), int(stopping)], dtype=torch.int64)
        self._group.allreduce([flags]).wait()  # type: ignore[attr-defined]  # a binding the stubs omit
        self.busy_anywhere, stopping_anywhere = bool(flags[0]), bool(flags[1])
        return self.busy_anywhere, stopping_anywhere
