"""Speculative decoding against plain decoding at a fixed concurrency, in one process: two engines (no speculation,
and `--speculative-config`) on the embedded model, each kept at `--concurrencies` running requests (a finished
request is replaced at once) over the same prompts of a `bench spec` workload, alternating rounds (the order flips
every round). No HTTP and no client process, so a round's ratio moves by ~5% where `scripts/spec_sweep.py`'s move by
~10%. Prints, per concurrency, the median output tok/s of each side, the ratio per round and its median, and the
adaptive verifier's state (acceptance rates, cost corrections, its judgement of drafting at that load).

    python scripts/spec_concurrency_ab.py --workload code-edit --concurrencies 1,4,16 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deltaserve.bench.spec_workloads import WORKLOADS, build_workload
from deltaserve.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from deltaserve.default_model import default_model_dir
from deltaserve.engine.engine_core import EngineCore
from deltaserve.sampling_params import SamplingParams
from deltaserve.text.tokenizer import Tokenizer


def run_at(core: EngineCore, prompts: list[list[int]], concurrency: int, params: SamplingParams, tag: str) -> float:
    """Output tokens per second of `prompts` kept `concurrency` at a time."""
    queue, tokens, n = list(prompts), 0, 0
    start = time.perf_counter()
    while queue or core.has_unfinished_requests():
        while queue and len(core.scheduler.requests) < concurrency:
            core.add_request(f"{tag}-{n}", queue.pop(0), params)
            n += 1
        tokens += sum(len(out.new_token_ids) for out in core.step())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="code-edit", choices=WORKLOADS)
    ap.add_argument("--concurrencies", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speculative-config", default='{"method": "dspark", "num_speculative_tokens": 7}')
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(default_model_dir())
    concurrencies = [int(c) for c in args.concurrencies.split(",")]

    def engine(spec: SpeculativeConfig | None) -> EngineCore:
        return EngineCore(EngineConfig(model=model, num_threads=args.threads, speculative_config=spec,
                                       scheduler=SchedulerConfig(max_num_seqs=max(concurrencies))))

    cores = {"plain": engine(None), "spec": engine(SpeculativeConfig.from_json(args.speculative_config))}
    num_prompts = max(2 * max(concurrencies), 12)
    workload = build_workload(args.workload, Tokenizer.from_pretrained(model), model, num_prompts, 0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=workload.ignore_eos)
    for name, core in cores.items():  # warm-up
        run_at(core, workload.prompts[:8], 4, params, f"warm-{name}")
    hook = cores["spec"].proposer_hook
    verifier = None if hook is None else hook.verifier
    for c in concurrencies:
        prompts = workload.prompts[:max(2 * c, 12)]
        rates: dict[str, list[float]] = {name: [] for name in cores}
        for r in range(args.rounds):
            for name in list(cores) if r % 2 == 0 else list(cores)[::-1]:
                rates[name].append(run_at(cores[name], prompts, c, params, f"{c}-{r}-{name}"))
        ratios = [s / p for s, p in zip(rates["spec"], rates["plain"], strict=True)]
        plain, spec = statistics.median(rates["plain"]), statistics.median(rates["spec"])
        print(f"c={c}: plain {plain:.1f} tok/s, spec {spec:.1f} tok/s, ratio {statistics.median(ratios):.3f} "
              f"(rounds {' '.join(f'{x:.2f}' for x in ratios)})", flush=True)
        if verifier is not None:
            gain, _ = verifier._judge(c, 400, 0, 0)  # noqa: SLF001 - a benchmark's view of the policy
            print(f"  verifier: {verifier.stats}; acceptance rates "
                  f"{[None if x is None else round(x, 2) for x in verifier.acceptance_rates]}; corrections "
                  f"{tuple(round(x, 2) for x in verifier.cost_corrections)}, fixed "
                  f"{1e3 * verifier.verify_overhead:.2f} ms; drafting at this load judged {gain:.2f}x plain",
                  flush=True)


if __name__ == "__main__":
    main()
