"""What a speculative target step costs: pure decode steps that verify j proposed tokens per sequence (j = 0 is plain
decoding), with the time inside each kind of module, on the embedded model (or --model).

A proposer that always proposes j copies of the sequence's last token (nearly always rejected, so every step verifies
exactly j and gains one token) isolates the verification cost from the acceptance. Prints, per batch size and j, the
median step time, the model forward and the summed per-step time inside KDA, MLA, MoE and dense-FFN modules.

    python scripts/spec_step_cost.py --batch-sizes 1,8,32 --proposed 0,1,2,3,5 --threads 1
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from deltaserve.config import CacheConfig, EngineConfig, SchedulerConfig
from deltaserve.default_model import default_model_dir
from deltaserve.engine.engine_core import EngineCore
from deltaserve.executor.uniproc import UniprocExecutor
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec_decode.proposer import Proposal


class RepeatLastProposer:
    """Proposes `j` copies of each sequence's last token (j = 0: nothing, a plain decode step)."""

    def __init__(self, j: int) -> None:
        self.j = j

    @property
    def num_speculative_tokens(self) -> int:
        return max(self.j, 1)

    @property
    def memory_bytes(self) -> int:
        return 0

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        if not self.j:
            return {}
        return {r.request_id: Proposal([(r.output_token_ids or r.prompt_token_ids)[-1]] * self.j) for r in requests}

    def forget(self, request_id: str) -> None:
        pass


def measure(model: str, batch: int, j: int, steps: int, prompt_len: int) -> dict[str, float]:
    cfg = EngineConfig(model=model, cache=CacheConfig(cache_memory="256MiB", enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=max(batch, 1)))
    core = EngineCore(cfg, proposer=RepeatLastProposer(j))
    assert isinstance(core.executor, UniprocExecutor)
    inside: dict[str, float] = collections.defaultdict(float)
    started: dict[int, float] = {}
    target: Any = core.executor.worker.model  # a KimiLinearForCausalLM (the Model protocol has no layer list)
    for layer in target.decoder_layers:
        for mod in (layer.self_attn, layer.mlp):
            kind = type(mod).__name__
            mod.register_forward_pre_hook(lambda m, a: started.__setitem__(id(m), time.perf_counter()))
            mod.register_forward_hook(lambda m, a, o, kind=kind: inside.__setitem__(
                kind, inside[kind] + time.perf_counter() - started[id(m)]))
    gen = torch.Generator().manual_seed(0)
    vocab = core.model_config.vocab_size - 32
    for i in range(batch):
        core.add_request(f"r{i}", torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
                         SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill
    core.step()
    step_s, forward_s = [], []
    inside.clear()
    for _ in range(steps):
        total, forward = core.stats.total_seconds, core.stats.forward_seconds
        core.step()
        step_s.append(core.stats.total_seconds - total)
        forward_s.append(core.stats.forward_seconds - forward)
    core.shutdown()
    out = {"step_ms": 1e3 * statistics.median(step_s), "forward_ms": 1e3 * statistics.median(forward_s)}
    out |= {k: 1e3 * v / steps for k, v in sorted(inside.items())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--proposed", default="0,1,2,3,5", help="values of j")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for batch in (int(x) for x in args.batch_sizes.split(",")):
        base = None
        for j in (int(x) for x in args.proposed.split(",")):
            r = measure(args.model, batch, j, args.steps, args.prompt_len)
            base = base or r["step_ms"]
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k not in ("step_ms", "forward_ms"))
            print(f"batch {batch:3d} j={j}: step {r['step_ms']:6.2f} ms ({r['step_ms'] / base:.2f}x j=0), "
                  f"forward {r['forward_ms']:6.2f} ms; inside modules (mean ms/step): {parts}", flush=True)


if __name__ == "__main__":
    main()
