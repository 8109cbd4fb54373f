"""`deltaserve bench offline`: engine throughput without HTTP, deltaserve vs transformers on the same checkpoint.

Both sides get the same random prompts (fixed input length) and must produce exactly `output_len` tokens each
(eos ignored); transformers runs them as one batch through `generate` (the prompts have equal lengths, so no
padding is needed). Prints output tokens/s of each, their ratio, the share of deltaserve's step time spent
outside the model forward (scheduling, batch building, sampling, detokenizing), and the share of the decode
roofline its pure decode steps reach (`bench/roofline.py`: bytes and FLOPs per step against the device's
measured or known ceilings).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.models.protocol import Model
    from deltaserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class OfflineBenchArgs:
    """Workload of the offline benchmark."""

    model: str | None = None
    """Checkpoint directory (default: write the default tiny checkpoint to a temporary directory)."""
    num_prompts: int = 32
    """Concurrent requests."""
    input_len: int = 256
    """Prompt tokens per request."""
    output_len: int = 128
    """Generated tokens per request."""
    dtype: str = "float32"
    """'float32' or 'bfloat16' for both engines."""
    seed: int = 0
    """Seed of the random prompts."""
    device: str = "cpu"
    """'cpu', 'cuda' or 'cuda:N' for both engines."""
    baseline: bool = True
    """Also run transformers' generate on the same prompts and print the ratio."""
    max_num_batched_tokens: int = 2048
    """deltaserve's per-step token budget."""
    result_file: str | None = None
    """Write the results as JSON here."""
    roofline: bool = True
    """Report the share of the decode roofline (bytes per step / bandwidth) reached by deltaserve's decode steps."""
    peak_bandwidth_gbs: float | None = None
    """Memory bandwidth ceiling in GB/s for the roofline (default: known figure for the GPU, else measured)."""
    speculative_config: str | None = None
    """deltaserve's speculative decoding, as JSON with vLLM's keys ('{"method": "ngram", "num_speculative_tokens":
    3}'); the result then has its acceptance counters."""
    enforce_eager: bool = False
    """deltaserve without CUDA graphs (run once with and once without to see what the graphs give on a GPU)."""

    def __post_init__(self) -> None:
        from deltaserve.config import SpeculativeConfig
        from deltaserve.utils.cli_args import check_at_least_one

        if self.speculative_config is not None:
            SpeculativeConfig.from_json(self.speculative_config)  # a bad config fails before any work

        check_at_least_one(self, "num_prompts", "input_len", "output_len", "max_num_batched_tokens")


def random_prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 32, (num, length), generator=gen).tolist()  # below the special tokens


def warmup_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Two prompts of the benchmark's length that share no prefix with the timed ones (token ids reversed)."""
    return [p[::-1] for p in prompts[:2]]


def run_deltaserve(args: OfflineBenchArgs, model: str, prompts: list[list[int]]) -> dict[str, Any]:
    from deltaserve.entrypoints.llm import LLM
    from deltaserve.sampling_params import SamplingParams

    llm = LLM(model=model, dtype=args.dtype, device=args.device, max_num_seqs=max(64, args.num_prompts),
              max_num_batched_tokens=args.max_num_batched_tokens, speculative_config=args.speculative_config,
              enforce_eager=args.enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up (both engines alike): two other full-length prompts, a few tokens each, so first-use costs are not
    # timed (other prompts, so that prefix caching, on as by default, gets no hits from them).
    llm.generate(warmup_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    stats_before = (llm.engine.stats.total_seconds, llm.engine.stats.forward_seconds)
    decode_steps: list[tuple[list[int], float]] = []  # (context of each sequence, seconds) of pure decode steps

    def observe(out: SchedulerOutput, seconds: float) -> None:
        if out.chunks and all(c.is_decode for c in out.chunks):
            decode_steps.append(([c.num_computed_tokens + 1 for c in out.chunks], seconds))

    llm.engine.step_observer = observe
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.engine.step_observer = None
    total = llm.engine.stats.total_seconds - stats_before[0]
    forward = llm.engine.stats.forward_seconds - stats_before[1]
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result: dict[str, Any] = {"seconds": elapsed, "output_tokens": num_out, "output_throughput": num_out / elapsed,
                              "engine_overhead_share": 1 - forward / total, "frontend_share": 1 - total / elapsed}
    if args.speculative_config is not None:  # counters since start-up: the warm-up's few steps included
        stats = llm.engine.get_stats()
        result["spec_decode"] = {"num_drafts": stats.spec_num_drafts, "num_draft_tokens": stats.spec_num_draft_tokens,
                                 "num_accepted_tokens": stats.spec_num_accepted_tokens,
                                 "accepted_per_pos": list(stats.spec_accepted_per_pos)}
    from deltaserve.executor.uniproc import UniprocExecutor

    executor = llm.engine.executor
    runner = executor.worker.runner if isinstance(executor, UniprocExecutor) else None
    graphs = None if runner is None else runner.graphs
    result["cuda_graphs"] = {"captured": graphs is not None and graphs.captured,
                             "sizes": [] if graphs is None else list(graphs.sizes),
                             "replays": 0 if graphs is None else graphs.replays}
    if args.roofline:
        executor = llm.engine.executor
        if not isinstance(executor, UniprocExecutor):
            raise ValueError("--roofline reads the model's bytes: it needs the in-process executor")
        result["roofline"] = decode_roofline(args, executor.worker.model, decode_steps)
    return result


def decode_roofline(args: OfflineBenchArgs, model: Model,
                    decode_steps: list[tuple[list[int], float]]) -> dict[str, Any]:
    """The §4 roofline share of the measured pure decode steps, with the ceilings and bytes it used."""
    from deltaserve.bench.roofline import measure_ceilings, model_bytes, roofline_share

    param = next(model.parameters())
    given = args.peak_bandwidth_gbs * 1e9 if args.peak_bandwidth_gbs is not None else None
    ceilings = measure_ceilings(param.device, param.dtype, bandwidth=given)
    mb = model_bytes(model)
    share = roofline_share(mb, ceilings, decode_steps)
    return {"share": share.share, "decode_steps": share.steps, "mean_batch": share.mean_batch,
            "mean_step_ms": share.mean_step_ms, "mean_bound_ms": share.mean_bound_ms,
            "mean_bytes_per_step": share.mean_bytes, "bandwidth_bytes_per_s": ceilings.bandwidth,
            "flops_per_s": ceilings.flops, "ceilings_source": ceilings.source, "model_bytes": asdict(mb)}


def run_transformers(args: OfflineBenchArgs, model: str, prompts: list[list[int]]) -> dict[str, float]:
    import torch

    from deltaserve.utils.hf_kimi import kimi_linear_for_causal_lm

    try:
        import transformers
    except ImportError as exc:  # a test-only dependency
        raise SystemExit("the baseline needs transformers: pip install 'deltaserve[test]'") from exc
    # On a GPU the baseline is transformers with fla's kernels (the anchor); on a CPU its own PyTorch KDA.
    cls = transformers.KimiLinearForCausalLM if args.device.startswith("cuda") else kimi_linear_for_causal_lm()
    hf = cls.from_pretrained(model, dtype=getattr(torch, args.dtype))
    # transformers wraps `to` in functools.wraps(nn.Module.to), so mypy reads its first argument as `self`.
    hf = hf.to(args.device).eval()  # type: ignore[arg-type]
    hf.generation_config.eos_token_id = None
    ids = torch.tensor(prompts, device=args.device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.output_len,
                  min_new_tokens=args.output_len, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        warm = torch.tensor(warmup_prompts(prompts), device=args.device)
        hf.generate(warm, **{**kwargs, "attention_mask": torch.ones_like(warm), "max_new_tokens": 4,
                             "min_new_tokens": 4})  # warm-up, as for deltaserve
        sync()
        start = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        sync()
        elapsed = time.perf_counter() - start
    num_out = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"seconds": elapsed, "output_tokens": num_out, "output_throughput": num_out / elapsed}


def run(args: OfflineBenchArgs) -> dict[str, Any]:
    from deltaserve.config import ModelConfig
    from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint

    model = args.model or str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="ds-bench-"), TinySpec()))
    vocab = ModelConfig.from_pretrained(model).vocab_size
    prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed)
    print(f"offline benchmark: {args.num_prompts} requests x {args.input_len} in / {args.output_len} out, "
          f"{args.dtype}, checkpoint {model}", flush=True)
    print("running deltaserve ...", flush=True)
    ours = run_deltaserve(args, model, prompts)
    result: dict[str, Any] = {"config": asdict(args), "deltaserve": ours}
    print(f"deltaserve:   {ours['output_throughput']:8.1f} output tok/s ({ours['seconds']:.2f} s); "
          f"{ours['engine_overhead_share']:.1%} of engine step time outside the model forward, "
          f"{ours['frontend_share']:.1%} of wall time in the frontend", flush=True)
    if ours["cuda_graphs"]["captured"]:
        cg = ours["cuda_graphs"]
        print(f"CUDA graphs: sizes {cg['sizes']}, {cg['replays']} decode steps replayed", flush=True)
    if "spec_decode" in ours:
        sd = ours["spec_decode"]
        print(f"speculative decoding: {sd['num_accepted_tokens']} of {sd['num_draft_tokens']} proposed tokens "
              f"accepted over {sd['num_drafts']} drafts (mean acceptance length "
              f"{1 + sd['num_accepted_tokens'] / max(sd['num_drafts'], 1):.2f})", flush=True)
    if "roofline" in ours:
        r = ours["roofline"]
        print(f"decode roofline: {r['share']:.1%} over {r['decode_steps']} decode steps (mean batch "
              f"{r['mean_batch']:.1f}: {r['mean_bytes_per_step'] / 2**20:.1f} MiB/step, bound {r['mean_bound_ms']:.2f} "
              f"ms, measured {r['mean_step_ms']:.2f} ms; {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
              f"{r['flops_per_s'] / 1e12:.2f} TFLOP/s, {r['ceilings_source']})", flush=True)
    if args.baseline:
        print("running transformers generate (one batch) ...", flush=True)
        hf = run_transformers(args, model, prompts)
        result["transformers"] = hf
        result["speedup"] = ours["output_throughput"] / hf["output_throughput"]
        print(f"transformers: {hf['output_throughput']:8.1f} output tok/s ({hf['seconds']:.2f} s)")
        print(f"speedup (deltaserve / transformers): {result['speedup']:.2f}x")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
    return result


def add_parser(sub: argparse._SubParsersAction) -> None:
    from deltaserve.utils.cli_args import add_dataclass_args

    p = sub.add_parser("offline", help="engine throughput without HTTP, against transformers")
    add_dataclass_args(p, OfflineBenchArgs)
    p.set_defaults(func=lambda a: (run(_args(a)), 0)[1])


def _args(ns: argparse.Namespace) -> OfflineBenchArgs:
    from deltaserve.utils.cli_args import dataclass_from_args

    return dataclass_from_args(OfflineBenchArgs, ns)
