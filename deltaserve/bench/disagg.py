"""`deltaserve bench disagg`: what prefill/decode disaggregation moves and costs per request, in one process.

For each prompt length: a prefill engine computes the prompt and publishes its cache, a decode engine fetches it
and decodes (the bytes moved, KV blocks and KDA state apart, counted by the engines themselves; the fetch's time
and throughput), against a unified engine running the same request alone: TTFT of each path, whether the outputs
are equal. Every engine is in this process (the transfer still crosses the transport's socket or shared memory).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deltaserve.bench.trace_replay import _print_table


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggBenchArgs:
    """Workload of the disaggregation benchmark."""

    model: str | None = None
    """Checkpoint directory (default: the embedded default model)."""
    prompt_lens: str = "1024,8192,32768"
    """Comma-separated prompt lengths in tokens."""
    output_len: int = 8
    """Tokens decoded per request."""
    kv_connectors: str = "shm,tcp"
    """Comma-separated transports to measure ('shm', 'tcp', 'nixl', 'mooncake'; missing libraries are skipped)."""
    raise_max_model_len: bool = True
    """Copy the checkpoint with its context limit raised to the longest prompt (its weights do not depend on it;
    outputs past the trained length are meaningless, bytes and times are what is measured)."""
    dtype: str = "float32"
    """'float32' or 'bfloat16'."""
    block_size: int = 16
    """Engine KV block size (tokens)."""
    max_num_batched_tokens: int = 4096
    """Engine per-step token budget."""
    rounds: int = 3
    """Requests per length and path (fresh prompts; the median is reported)."""
    seed: int = 0
    """Seed of the random prompts."""
    result_file: str | None = None
    """Write the results as JSON here."""


def _checkpoint(args: DisaggBenchArgs, longest: int) -> str:
    from deltaserve.config import ModelConfig
    from deltaserve.default_model import default_model_dir

    model = args.model or str(default_model_dir())
    if not args.raise_max_model_len or ModelConfig.from_pretrained(model).max_model_len > longest + args.output_len:
        return model
    out = Path(tempfile.mkdtemp(prefix="ds-disagg-"))
    for f in Path(model).iterdir():
        if f.is_file() and f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((Path(model) / "config.json").read_text())
    config["model_max_length"] = longest + args.output_len + 1
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def _engine(model: str, args: DisaggBenchArgs, role: str | None, connector: str) -> Any:
    from deltaserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from deltaserve.engine.engine_core import EngineCore

    kv = None if role is None else KVTransferConfig(kv_connector=connector, kv_role=role)
    return EngineCore(EngineConfig(
        model=model, dtype=args.dtype, kv_transfer_config=kv,
        cache=CacheConfig(block_size=args.block_size, cache_memory="512MiB", host_cache_memory="256MiB"),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens)))


def _run(core: Any, rid: str, prompt: list[int], max_tokens: int, params: dict | None) -> dict[str, Any]:
    from deltaserve.sampling_params import SamplingParams

    start = time.perf_counter()
    core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                     kv_transfer_params=params)
    out: dict[str, Any] = {"ids": []}
    while core.has_unfinished_requests():
        for o in core.step():
            out.setdefault("ttft_s", time.perf_counter() - start)
            out["ids"] += o.new_token_ids
            if o.kv_transfer_params is not None:
                out["kv_transfer_params"] = o.kv_transfer_params
    out["e2el_s"] = time.perf_counter() - start
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run_disagg(args: DisaggBenchArgs) -> dict[str, Any]:
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    model = _checkpoint(args, max(lengths))
    from deltaserve.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model).vocab_size
    rng = random.Random(args.seed)
    results: dict[str, Any] = {"config": asdict(args), "model": model, "connectors": {}}
    unified = _engine(model, args, None, "shm")
    rows: list[tuple[str, ...]] = []
    for connector in args.kv_connectors.split(","):
        try:
            prefill, decode = _engine(model, args, "kv_producer", connector), _engine(model, args, "kv_consumer",
                                                                                        connector)
        except ImportError as exc:
            print(f"{connector}: skipped ({exc})", flush=True)
            continue
        per_len = {}
        for n in lengths:
            samples: dict[str, list[float]] = {"unified": [], "prefill": [], "decode": [], "fetch": []}
            before = decode.get_stats()
            equal = True
            for r in range(args.rounds):
                print(f"{connector}: {n}-token prompt, round {r + 1}/{args.rounds} ...", flush=True)
                prompt = [rng.randrange(vocab - 32) for _ in range(n)]
                u = _run(unified, f"u-{connector}-{n}-{r}", prompt, args.output_len, None)
                p = _run(prefill, f"p-{connector}-{n}-{r}", prompt, 1, {"do_remote_decode": True})
                s0 = decode.get_stats().kv_transfer_seconds
                d = _run(decode, f"d-{connector}-{n}-{r}", prompt, args.output_len, p.get("kv_transfer_params"))
                samples["unified"].append(u["ttft_s"])
                samples["prefill"].append(p["e2el_s"])
                samples["decode"].append(d["ttft_s"])
                samples["fetch"].append(decode.get_stats().kv_transfer_seconds - s0)
                equal &= u["ids"] == d["ids"]
            after = decode.get_stats()
            kv = (after.kv_transfer_received_kv_bytes - before.kv_transfer_received_kv_bytes) / args.rounds
            state = (after.kv_transfer_received_state_bytes - before.kv_transfer_received_state_bytes) / args.rounds
            fetch = _median(samples["fetch"])
            per_len[n] = {"kv_bytes": kv, "state_bytes": state, "fetch_s": fetch,
                          "gb_per_s": (kv + state) / fetch / 1e9 if fetch else 0.0,
                          "received": after.kv_transfer_received - before.kv_transfer_received,
                          "failures": after.kv_transfer_failures - before.kv_transfer_failures,
                          "outputs_equal": equal, **{f"{k}_ttft_s": _median(v) for k, v in samples.items()
                                                     if k != "fetch"}}
            rows.append((connector, str(n), f"{kv / 2**20:.2f}", f"{state / 2**20:.3f}",
                         f"{state / (kv + state):.1%}", f"{fetch * 1000:.1f}", f"{per_len[n]['gb_per_s']:.2f}",
                         f"{per_len[n]['unified_ttft_s'] * 1000:.0f}", f"{per_len[n]['prefill_ttft_s'] * 1000:.0f}",
                         f"{per_len[n]['decode_ttft_s'] * 1000:.0f}", "yes" if equal else "NO"))
        results["connectors"][connector] = per_len
        prefill.shutdown()
        decode.shutdown()
    unified.shutdown()
    _print_table(("transport", "prompt", "KV MiB", "state MiB", "state share", "fetch ms", "GB/s", "unified TTFT ms",
                  "prefill ms", "decode TTFT ms", "equal"), rows)
    if model != (args.model or "") and model.startswith(tempfile.gettempdir()):
        shutil.rmtree(model, ignore_errors=True)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2) + "\n")
    return results


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `disagg` under `deltaserve bench`."""
    from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args

    p = sub.add_parser("disagg", help="bytes (KV vs state), fetch time and TTFT of prefill/decode disaggregation")
    add_dataclass_args(p, DisaggBenchArgs)
    p.set_defaults(func=lambda a: (run_disagg(dataclass_from_args(DisaggBenchArgs, a)), 0)[1])
