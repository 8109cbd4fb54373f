"""`deltaserve bench spec`: speculative decoding against plain decoding, side by side in one process.

Two `LLM`s on the same checkpoint, one without and one with the given `--speculative-config` (prefix caching off in
both, so every run computes its prompts), are warmed up, then run the same prompts alternately: for each batch size,
`--rounds` rounds of one run each, the order flipped every round (AB, BA, AB, ...) so that a drift of the machine
hits both alike. A run at batch size b generates for max(b, `--min-prompts`) prompts of the workload, b at a time.

Printed and returned per batch size: output tokens/s of both (median over rounds; wall time of `generate`), the
ratio of the medians and the per-round ratios, the decode-step view (steps in which every sequence decodes: their
mean time, the model forward and the proposer inside them, tokens gained per sequence and step, and tokens/s over
those steps alone) and the acceptance counters of the timed runs (mean acceptance length = 1 + accepted / drafts,
vLLM's definition; acceptance per position = drafts whose j-th token was accepted / drafts). Greedy runs (the
default) also check that both engines generated the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.entrypoints.llm import LLM
    from deltaserve.request import Request
    from deltaserve.scheduler.output import SchedulerOutput


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecBenchArgs:
    """What `deltaserve bench spec` compares."""

    speculative_config: str = '{"method": "ngram", "num_speculative_tokens": 3}'
    """The speculative side, as JSON with vLLM's keys (the other side decodes plainly)."""
    model: str | None = None
    """Checkpoint directory (default: the embedded model, deltaserve/default_model)."""
    workload: str = "code-edit"
    """'code-edit' (rename a variable in a standard-library function: the output copies the prompt), 'tool-chat'
    (the embedded model's own domain: chats about its five tools) or 'random' (random token prompts)."""
    batch_sizes: str = "1,8,32"
    """Comma-separated numbers of concurrent requests."""
    rounds: int = 3
    """Runs of each engine per batch size (alternating)."""
    min_prompts: int = 8
    """Prompts per run at least (a run at a smaller batch size runs them b at a time, one batch after the other)."""
    output_len: int = 128
    """max_tokens of every request (random prompts generate exactly this many; the others stop at eos)."""
    temperature: float = 0.0
    """0: greedy (both engines must generate the same tokens); above: sampled, with a seed per request."""
    seed: int = 0
    """Seed of the workload and of sampled requests."""
    dtype: str = "float32"
    """'float32' or 'bfloat16'."""
    device: str = "cpu"
    """'cpu', 'cuda' or 'cuda:N'."""
    num_threads: int | None = None
    """torch threads (default: torch's choice)."""
    cache_memory: str = "512MiB"
    """Cache budget of each engine."""
    result_file: str | None = None
    """Write the results as JSON here."""

    def __post_init__(self) -> None:
        from deltaserve.bench.spec_workloads import WORKLOADS
        from deltaserve.config import SpeculativeConfig
        from deltaserve.utils.cli_args import check_at_least_one

        SpeculativeConfig.from_json(self.speculative_config)  # a bad config fails before any work
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        parse_batch_sizes(self.batch_sizes)
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        check_at_least_one(self, "rounds", "min_prompts", "output_len")


def parse_batch_sizes(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; ValueError naming the option otherwise."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be integers >= 1, got {text!r}")
    return sizes


@dataclass(slots=True)
class RunStats:
    """One timed run of one engine."""

    seconds: float = 0.0
    output_tokens: int = 0
    decode_steps: int = 0
    """Steps in which every scheduled sequence decodes (one new token, plus proposed ones)."""
    decode_seconds: float = 0.0
    decode_forward_seconds: float = 0.0
    decode_propose_seconds: float = 0.0
    decode_rows: int = 0
    """Sequences summed over those steps."""
    decode_tokens: int = 0
    """Output tokens those steps produced (after stop tokens cut them)."""
    output_ids: list[list[int]] = field(default_factory=list)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_throughput(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def summary(self) -> dict[str, Any]:
        steps = max(self.decode_steps, 1)
        return {"seconds": self.seconds, "output_tokens": self.output_tokens,
                "output_throughput": self.output_throughput, "decode_throughput": self.decode_throughput,
                "decode_steps": self.decode_steps, "mean_decode_step_ms": 1e3 * self.decode_seconds / steps,
                "mean_decode_forward_ms": 1e3 * self.decode_forward_seconds / steps,
                "mean_decode_propose_ms": 1e3 * self.decode_propose_seconds / steps,
                "mean_decode_batch": self.decode_rows / steps,
                "tokens_per_sequence_step": self.decode_tokens / max(self.decode_rows, 1)}


class _TimedProposer:
    """Wraps the engine's proposer to add up the time its `propose` calls take (the draft model's forwards)."""

    def __init__(self, inner: Any) -> None:  # a spec_decode Proposer (a layer this package does not import)
        self.inner = inner
        self.seconds = 0.0

    @property
    def num_speculative_tokens(self) -> int:
        return int(self.inner.num_speculative_tokens)

    @property
    def memory_bytes(self) -> int:
        return int(self.inner.memory_bytes)

    def propose(self, requests: Sequence[Request]) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            proposals: dict[str, Any] = self.inner.propose(requests)
            return proposals
        finally:
            self.seconds += time.perf_counter() - start

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)

    def receive(self, drafts: Any) -> None:
        """A block drafter's drafts from the workers (the engine hands them to any proposer that takes them)."""
        receive = getattr(self.inner, "receive", None)
        if receive is not None:
            receive(drafts)


class _StepRecorder:
    """The engine's step observer during a run: adds the pure decode steps' time, forward, proposer time, rows and
    the tokens they produced (from the requests' output lengths, so tokens after a stop are not counted)."""

    def __init__(self, llm: LLM, timer: _TimedProposer | None, stats: RunStats) -> None:
        self.llm, self.timer, self.stats = llm, timer, stats
        self.requests: dict[str, Request] = {}
        self.lengths: dict[str, int] = {}
        self.forward = llm.engine.stats.forward_seconds
        self.propose = timer.seconds if timer is not None else 0.0

    def __call__(self, out: SchedulerOutput, seconds: float) -> None:
        total_forward = self.llm.engine.stats.forward_seconds
        forward, self.forward = total_forward - self.forward, total_forward
        now = self.timer.seconds if self.timer is not None else 0.0
        propose, self.propose = now - self.propose, now
        pure = bool(out.chunks) and all(len(c.new_token_ids) - c.num_proposed == 1 and c.request_id in self.requests
                                        for c in out.chunks)
        gained = 0
        for c in out.chunks:
            request = self.requests.get(c.request_id)
            if request is not None:
                gained += len(request.output_token_ids) - self.lengths[c.request_id]
                self.lengths[c.request_id] = len(request.output_token_ids)
        for request in self.llm.engine.scheduler.running:
            self.requests[request.request_id] = request
            self.lengths[request.request_id] = len(request.output_token_ids)
        if pure:
            s = self.stats
            s.decode_steps += 1
            s.decode_seconds += seconds
            s.decode_forward_seconds += forward
            s.decode_propose_seconds += propose
            s.decode_rows += len(out.chunks)
            s.decode_tokens += gained


@dataclass(slots=True)
class _Side:
    """One engine of the comparison."""

    name: str
    llm: LLM
    timer: _TimedProposer | None


def _make_side(name: str, args: SpecBenchArgs, model: str, max_num_seqs: int, spec: str | None) -> _Side:
    from deltaserve.entrypoints.llm import LLM

    llm = LLM(model=model, dtype=args.dtype, device=args.device, seed=args.seed, speculative_config=spec,
              num_threads=args.num_threads,
              max_num_seqs=max_num_seqs, cache_memory=args.cache_memory, enable_prefix_caching=False)
    hook = llm.engine.proposer_hook
    timer = None
    if hook is not None:
        timer = _TimedProposer(hook.proposer)
        hook.proposer = timer
    return _Side(name=name, llm=llm, timer=timer)


def _run(side: _Side, prompts: list[list[int]], batch: int, args: SpecBenchArgs, ignore_eos: bool) -> RunStats:
    from deltaserve.sampling_params import SamplingParams

    stats = RunStats()
    side.llm.engine.step_observer = _StepRecorder(side.llm, side.timer, stats)
    try:
        for start in range(0, len(prompts), batch):
            group = prompts[start:start + batch]
            params = [SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=ignore_eos,
                                     seed=None if args.temperature == 0 else args.seed + start + i)
                      for i in range(len(group))]
            t0 = time.perf_counter()
            outs = side.llm.generate(group, params)
            stats.seconds += time.perf_counter() - t0
            for o in outs:
                stats.output_ids.append(list(o.outputs[0].token_ids))
    finally:
        side.llm.engine.step_observer = None
    stats.output_tokens = sum(len(ids) for ids in stats.output_ids)
    return stats


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """The engine's cumulative speculative-decoding counters at one moment."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]


def _spec_counters(side: _Side) -> SpecCounters:
    s = side.llm.engine.get_stats()
    return SpecCounters(s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
                        tuple(s.spec_accepted_per_pos))


def acceptance(before: SpecCounters, after: SpecCounters) -> dict[str, Any]:
    """Acceptance over the counters' difference: drafts, draft and accepted tokens, the mean acceptance length and
    the acceptance rate per position (drafts whose j-th token was accepted / drafts)."""
    drafts, draft_tokens = after.drafts - before.drafts, after.draft_tokens - before.draft_tokens
    accepted = after.accepted - before.accepted
    old = before.accepted_per_pos
    per_pos = [a - (old[j] if j < len(old) else 0) for j, a in enumerate(after.accepted_per_pos)]
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos, "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "acceptance_per_pos": [a / drafts if drafts else 0.0 for a in per_pos]}


def compare_batch(base: _Side, spec: _Side, prompts: list[list[int]], batch: int, args: SpecBenchArgs,
                  ignore_eos: bool) -> dict[str, Any]:
    """`args.rounds` alternating runs of both engines at one batch size, and their summary."""
    before = _spec_counters(spec)
    runs: dict[str, list[RunStats]] = {"baseline": [], "speculative": []}
    mismatches = 0
    for r in range(args.rounds):
        order = (base, spec) if r % 2 == 0 else (spec, base)
        for side in order:
            runs[side.name].append(_run(side, prompts, batch, args, ignore_eos))
        if args.temperature == 0:
            a, b = runs["baseline"][-1].output_ids, runs["speculative"][-1].output_ids
            mismatches += sum(x != y for x, y in zip(a, b, strict=True))
    acc = acceptance(before, _spec_counters(spec))
    base_tps = [s.output_throughput for s in runs["baseline"]]
    spec_tps = [s.output_throughput for s in runs["speculative"]]
    ratios = [b / a for a, b in zip(base_tps, spec_tps, strict=True)]
    base_med, spec_med = statistics.median(base_tps), statistics.median(spec_tps)
    dec_base = statistics.median(s.decode_throughput for s in runs["baseline"])
    dec_spec = statistics.median(s.decode_throughput for s in runs["speculative"])
    return {
        "batch_size": batch, "num_prompts": len(prompts),
        "baseline_output_throughput": base_med, "speculative_output_throughput": spec_med,
        "ratio": spec_med / base_med if base_med else 0.0, "round_ratios": ratios,
        "median_round_ratio": statistics.median(ratios),
        "baseline_decode_throughput": dec_base, "speculative_decode_throughput": dec_spec,
        "decode_ratio": dec_spec / dec_base if dec_base else 0.0,
        "acceptance": acc,
        "greedy_mismatches": mismatches if args.temperature == 0 else None,
        "runs": {name: [s.summary() for s in rs] for name, rs in runs.items()},
    }


def format_batch(res: dict[str, Any]) -> str:
    """Console lines of one batch size."""
    acc = res["acceptance"]
    b0, s0 = res["runs"]["baseline"][0], res["runs"]["speculative"][0]

    def med(side: str, key: str) -> float:
        return statistics.median(run[key] for run in res["runs"][side])

    lines = [
        f"batch {res['batch_size']} ({res['num_prompts']} prompts, {len(res['round_ratios'])} rounds): "
        f"baseline {res['baseline_output_throughput']:.1f} tok/s, speculative "
        f"{res['speculative_output_throughput']:.1f} tok/s, ratio {res['ratio']:.2f}x "
        f"(per round {' '.join(f'{r:.2f}' for r in res['round_ratios'])})",
        f"  acceptance: mean length {acc['mean_acceptance_length']:.2f} over {acc['num_drafts']} drafts, "
        f"{acc['num_accepted_tokens']} of {acc['num_draft_tokens']} proposed tokens accepted; per position "
        + " ".join(f"{a:.2f}" for a in acc["acceptance_per_pos"]),
        f"  decode steps (median run): baseline {med('baseline', 'mean_decode_step_ms'):.2f} ms "
        f"(forward {med('baseline', 'mean_decode_forward_ms'):.2f}), speculative "
        f"{med('speculative', 'mean_decode_step_ms'):.2f} ms "
        f"(forward {med('speculative', 'mean_decode_forward_ms'):.2f}, "
        f"proposer {med('speculative', 'mean_decode_propose_ms'):.2f}); "
        f"{med('speculative', 'tokens_per_sequence_step'):.2f} tokens per sequence-step at mean batch "
        f"{s0['mean_decode_batch']:.1f} (baseline {b0['mean_decode_batch']:.1f}); decode-step tok/s "
        f"{res['baseline_decode_throughput']:.1f} vs {res['speculative_decode_throughput']:.1f} "
        f"({res['decode_ratio']:.2f}x)",
    ]
    if res["greedy_mismatches"]:
        lines.append(f"  WARNING: {res['greedy_mismatches']} greedy outputs differ between the engines")
    return "\n".join(lines)


def run(args: SpecBenchArgs) -> dict[str, Any]:
    import torch

    from deltaserve.bench.spec_workloads import build_workload
    from deltaserve.default_model import default_model_dir
    from deltaserve.sampling_params import SamplingParams

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    model = args.model or str(default_model_dir())
    sizes = parse_batch_sizes(args.batch_sizes)
    base = _make_side("baseline", args, model, max(sizes), None)
    spec = _make_side("speculative", args, model, max(sizes), args.speculative_config)
    num = max(max(sizes), args.min_prompts)
    workload = build_workload(args.workload, base.llm.tokenizer, model, num, args.seed)
    print(f"speculative decoding A/B: {args.speculative_config} vs none, workload {args.workload} ({num} prompts, "
          f"mean {statistics.mean(len(p) for p in workload.prompts):.0f} tokens; max_tokens {args.output_len}, "
          f"eos {'ignored' if workload.ignore_eos else 'stops'}), temperature {args.temperature}, checkpoint {model}, "
          f"{torch.get_num_threads()} threads", flush=True)
    for side in (base, spec):  # warm-up: the largest batch, a few tokens, untimed
        side.llm.generate(workload.prompts[:max(sizes)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    result: dict[str, Any] = {"config": asdict(args), "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                              "workload": {"name": workload.name, "num_prompts": num,
                                           "mean_prompt_len": statistics.mean(len(p) for p in workload.prompts),
                                           "ignore_eos": workload.ignore_eos, "sources": workload.sources},
                              "batch_sizes": []}
    try:
        for b in sizes:
            prompts = workload.prompts[:max(b, args.min_prompts)]
            res = compare_batch(base, spec, prompts, b, args, workload.ignore_eos)
            result["batch_sizes"].append(res)
            print(format_batch(res), flush=True)
    finally:
        for side in (base, spec):
            side.llm.engine.shutdown()
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
    return result


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `spec` under `deltaserve bench`."""
    from deltaserve.utils.cli_args import add_dataclass_args

    p = sub.add_parser("spec", help="speculative decoding vs plain decoding, alternating in one process",
                       description=__doc__.splitlines()[0])
    add_dataclass_args(p, SpecBenchArgs)
    p.set_defaults(func=lambda a: (run(_args(a)), 0)[1])


def _args(ns: argparse.Namespace) -> SpecBenchArgs:
    from deltaserve.utils.cli_args import dataclass_from_args

    return dataclass_from_args(SpecBenchArgs, ns)
