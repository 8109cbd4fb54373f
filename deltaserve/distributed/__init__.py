"""Ranks and collectives: the process group of one engine replica's workers (`group.py`) and how a checkpoint
tensor is split over it (`shard.py`). torch.distributed underneath: gloo on a CPU, NCCL on CUDA."""

from deltaserve.distributed.group import SINGLE, ParallelGroup, init_parallel_group
from deltaserve.distributed.shard import Shard, shard_range, split_along

__all__ = ["SINGLE", "ParallelGroup", "Shard", "init_parallel_group", "shard_range", "split_along"]
