"""`deltaserve bench vision`: what images cost and what the encoder cache saves, on engines in this process.

Three measurements, each timed by the engine's own counters and clocks:

1. encoder time per image by resolution (square images; a fresh image per round, so no cache hit);
2. a multi-turn conversation that shows the same image again in a later turn (history carried, prefix caching on):
   encoder-cache lookups, hits and images encoded per turn, and the hit rate;
3. TTFT of an image prompt with the encoder cache and without it (`encoder_cache_memory=0`): a cold image whose
   placeholders span several prefill chunks, then the same image under another question (prefix caching off, so
   only the encoder cache can help).

Without `--model` the checkpoint is a tiny random K3 whose tower has K3's width (1152, 16 heads, MLP 4304, patch 14)
and `--tower-layers` of its 27 blocks: per-block time times 27 estimates the real tower on this machine.
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

K3_TOWER_LAYERS = 27


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionBenchArgs:
    """Workload of the vision benchmark."""

    model: str | None = None
    """A checkpoint with a vision tower (default: a tiny random K3 with a K3-width tower of --tower-layers blocks)."""
    tower_layers: int = 2
    """Blocks of the default checkpoint's tower (K3 has 27)."""
    resolutions: str = "224,448,896"
    """Comma-separated square image sides in pixels, for the encoder timing."""
    rounds: int = 3
    """Images per resolution and requests per TTFT case (the median is reported)."""
    chunk_tokens: int = 64
    """Prefill token budget per step for the TTFT cases (smaller than the image, so chunks split it)."""
    ttft_resolution: int = 448
    """Image side for the conversation and the TTFT cases."""
    output_len: int = 4
    """Tokens decoded per turn."""
    seed: int = 0
    result_file: str | None = None
    """Write the results as JSON here."""


def _checkpoint(args: VisionBenchArgs) -> tuple[str, bool]:
    """(checkpoint path, whether it is a temporary one to delete)."""
    if args.model:
        return args.model, False
    from deltaserve.models.tiny_k3 import write_tiny_k3_checkpoint
    from deltaserve.models.tiny_spec import TinySpec
    from deltaserve.models.tiny_vision import TinyVisionSpec

    out = Path(tempfile.mkdtemp(prefix="ds-vision-bench-"))
    print(f"writing a tiny K3 checkpoint with a {args.tower_layers}-block K3-width tower to {out} ...", flush=True)
    tower = TinyVisionSpec(hidden=1152, layers=args.tower_layers, heads=16, intermediate=4304, pos_emb_height=64,
                           pos_emb_width=64)
    write_tiny_k3_checkpoint(out, TinySpec(arch="kimi_k3", seed=args.seed), vision=True, vision_spec=tower)
    return str(out), True


class _Bench:
    """The checkpoint's image settings and engines over it."""

    def __init__(self, model: str, args: VisionBenchArgs) -> None:
        from deltaserve.config import ModelConfig
        from deltaserve.multimodal import ImageProcessingConfig

        config = ModelConfig.from_pretrained(model)
        if config.vision is None:
            raise ValueError(f"{model} has no vision tower")
        self.model, self.args = model, args
        self.vocab = config.vocab_size
        self.processing = ImageProcessingConfig.for_vision(config.vision)
        self.placeholder = config.vision.media_placeholder_token_id
        self.rng = random.Random(args.seed)

    def engine(self, *, budget: int, prefix: bool, encoder_cache: bool) -> Any:
        from deltaserve.config import CacheConfig, EngineConfig, SchedulerConfig
        from deltaserve.engine.engine_core import EngineCore

        return EngineCore(EngineConfig(model=self.model, cache=CacheConfig(
            cache_memory="512MiB", enable_prefix_caching=prefix, encoder_cache_memory="512MiB" if encoder_cache else 0),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget)))

    def image(self, side: int, seed: int) -> Any:
        import numpy as np
        from PIL import Image

        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))

    def text(self, n: int) -> list[int]:
        return [self.rng.randrange(300, self.vocab - 32) for _ in range(n)]

    def prompt(self, pieces: list[Any]) -> tuple[list[int], tuple[Any, ...]]:
        """Token ids and images: each piece a list of ids or an image (placed on one placeholder, widened)."""
        from deltaserve.multimodal.prompt_images import place_images

        ids: list[int] = []
        images = []
        for piece in pieces:
            if isinstance(piece, list):
                ids += piece
            else:
                ids.append(self.placeholder)
                images.append(piece)
        return place_images(ids, images, self.processing, self.placeholder)

    def run(self, core: Any, rid: str, prompt: tuple[list[int], tuple[Any, ...]]) -> dict[str, Any]:
        from deltaserve.sampling_params import SamplingParams

        before = core.get_stats()
        start = time.perf_counter()
        core.add_request(rid, prompt[0], SamplingParams(temperature=0.0, max_tokens=self.args.output_len,
                                                        ignore_eos=True), images=prompt[1])
        out: dict[str, Any] = {"ids": []}
        while core.has_unfinished_requests():
            for o in core.step():
                out.setdefault("ttft_s", time.perf_counter() - start)
                out["ids"] += o.new_token_ids
        after = core.get_stats()
        out.update(encoded=after.images_encoded - before.images_encoded,
                   hits=after.encoder_cache_hits - before.encoder_cache_hits,
                   encoder_s=after.encoder_seconds - before.encoder_seconds,
                   prefix_hit_tokens=after.prefix_hit_tokens - before.prefix_hit_tokens)
        return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _encoder_by_resolution(bench: _Bench, layers: int | None) -> list[dict[str, Any]]:
    core = bench.engine(budget=8192, prefix=False, encoder_cache=True)
    bench.run(core, "warm-up", bench.prompt([bench.text(8), bench.image(112, 1), bench.text(8)]))
    rows = []
    for side in (int(s) for s in bench.args.resolutions.split(",")):
        times, tokens = [], 0
        for r in range(bench.args.rounds):
            print(f"encoder: {side} x {side}, round {r + 1}/{bench.args.rounds} ...", flush=True)
            prompt = bench.prompt([bench.text(8), bench.image(side, 1000 * side + r), bench.text(8)])
            tokens = prompt[1][0].num_tokens
            out = bench.run(core, f"enc-{side}-{r}", prompt)
            assert out["encoded"] == 1, out
            times.append(out["encoder_s"])
        row = {"side": side, "tokens": tokens, "encoder_ms": _median(times) * 1000}
        if layers:
            row["estimated_27_block_ms"] = row["encoder_ms"] / layers * K3_TOWER_LAYERS
        rows.append(row)
    core.shutdown()
    return rows


def _conversation(bench: _Bench) -> dict[str, Any]:
    """Four turns: an image and a question; a follow-up; the same image shown again with a question; a follow-up.
    Each turn's prompt is the whole history with the answers so far."""
    core = bench.engine(budget=bench.args.chunk_tokens, prefix=True, encoder_cache=True)
    image = bench.image(bench.args.ttft_resolution, 7)
    history: list[Any] = [bench.text(12), image, bench.text(10)]
    turns = []
    for turn in range(4):
        print(f"conversation: turn {turn + 1}/4 ...", flush=True)
        out = bench.run(core, f"turn-{turn}", bench.prompt(history))
        turns.append({k: out[k] for k in ("encoded", "hits", "prefix_hit_tokens", "ttft_s")})
        history += [out["ids"], bench.text(8)]
        if turn == 1:
            history += [image, bench.text(6)]
    core.shutdown()
    lookups = sum(t["encoded"] + t["hits"] for t in turns)
    return {"turns": turns, "lookups": lookups, "hits": sum(t["hits"] for t in turns),
            "hit_rate": sum(t["hits"] for t in turns) / lookups if lookups else 0.0}


def _ttft(bench: _Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    side = bench.args.ttft_resolution
    prompts = [(bench.prompt([bench.text(16), bench.image(side, 500 + r), bench.text(8)]),
                bench.prompt([bench.text(16), bench.image(side, 500 + r), bench.text(8)]))
               for r in range(bench.args.rounds)]  # the same requests for both engines
    for cached in (True, False):
        core = bench.engine(budget=bench.args.chunk_tokens, prefix=False, encoder_cache=cached)
        bench.run(core, "warm-up", bench.prompt([bench.text(16), bench.image(side, 499), bench.text(8)]))
        cold, warm, encoded, outputs = [], [], 0, []
        for r, (cold_prompt, repeat_prompt) in enumerate(prompts):
            name = "with" if cached else "without"
            print(f"TTFT {name} the encoder cache: round {r + 1}/{bench.args.rounds} ...", flush=True)
            first = bench.run(core, f"cold-{r}", cold_prompt)
            again = bench.run(core, f"warm-{r}", repeat_prompt)
            cold.append(first["ttft_s"])
            warm.append(again["ttft_s"])
            encoded += first["encoded"] + again["encoded"]
            outputs.append((first["ids"], again["ids"]))
        core.shutdown()
        out["with" if cached else "without"] = {"cold_ttft_ms": _median(cold) * 1000,
                                                "repeat_ttft_ms": _median(warm) * 1000,
                                                "tower_runs_per_request": encoded / (2 * bench.args.rounds),
                                                "outputs": outputs}
    out["outputs_equal"] = out["with"].pop("outputs") == out["without"].pop("outputs")
    return out


def run_vision(args: VisionBenchArgs) -> dict[str, Any]:
    model, temporary = _checkpoint(args)
    try:
        bench = _Bench(model, args)
        layers = None if args.model else args.tower_layers
        encoder = _encoder_by_resolution(bench, layers)
        conversation = _conversation(bench)
        ttft = _ttft(bench)
    finally:
        if temporary:
            shutil.rmtree(model, ignore_errors=True)
    _print_table(("image", "tokens", "encoder ms", *(["27-block estimate ms (scaled)"] if layers else [])),
                 [(f"{r['side']}x{r['side']}", str(r["tokens"]), f"{r['encoder_ms']:.0f}",
                   *([f"{r['estimated_27_block_ms']:.0f}"] if layers else [])) for r in encoder])
    _print_table(("turn", "images encoded", "encoder-cache hits", "prefix-hit tokens", "TTFT ms"),
                 [(str(i + 1), str(t["encoded"]), str(t["hits"]), str(t["prefix_hit_tokens"]),
                   f"{t['ttft_s'] * 1000:.0f}") for i, t in enumerate(conversation["turns"])])
    print(f"encoder-cache hit rate over the conversation: {conversation['hits']}/{conversation['lookups']} = "
          f"{conversation['hit_rate']:.0%}")
    _print_table(("encoder cache", "cold TTFT ms", "repeat TTFT ms", "tower runs per request"),
                 [(name, f"{ttft[name]['cold_ttft_ms']:.0f}", f"{ttft[name]['repeat_ttft_ms']:.0f}",
                   f"{ttft[name]['tower_runs_per_request']:.1f}") for name in ("with", "without")])
    print(f"repeat TTFT without / with the encoder cache: "
          f"{ttft['without']['repeat_ttft_ms'] / ttft['with']['repeat_ttft_ms']:.2f}x; "
          f"outputs equal with and without: {'yes' if ttft['outputs_equal'] else 'NO'}")
    results = {"config": asdict(args), "encoder": encoder, "conversation": conversation, "ttft": ttft}
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2) + "\n")
    return results


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `vision` under `deltaserve bench`."""
    from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args

    p = sub.add_parser("vision", help="encoder time by resolution, encoder-cache hit rate and TTFT with and without")
    add_dataclass_args(p, VisionBenchArgs)
    p.set_defaults(func=lambda a: (run_vision(dataclass_from_args(VisionBenchArgs, a)), 0)[1])
