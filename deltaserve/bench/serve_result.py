"""The result of one `bench serve` run: vLLM's JSON layout plus ours, its file name, and saving it (with plots)."""

from __future__ import annotations

import dataclasses
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench.datasets import Dataset
from deltaserve.bench.metrics import (
    METRICS,
    RequestOutcome,
    compute_metrics,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
)
from deltaserve.bench.serve_config import ServeBenchConfig

DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")
"""Per-request arrays saved only with --save-detailed (vLLM keeps latencies and queue_times in every file)."""


def warn_unexpected_hits(cfg: ServeBenchConfig, result: dict[str, Any]) -> None:
    """Random prompts without a shared prefix cannot hit the prefix cache unless the server saw them before (an
    earlier run with the same --seed): such a run measures cached prefills, so say so."""
    rate = result.get("prefix_cache_hit_rate")
    if cfg.dataset_name == "random" and cfg.random_prefix_len == 0 and rate:
        print(f"warning: {rate:.1%} of prompt tokens were prefix-cache hits although random prompts share nothing: "
              "the server has seen these prompts before (same --seed as an earlier run?); use another --seed or "
              "restart the server", file=sys.stderr)


def assemble_result(cfg: ServeBenchConfig, model: str, data: Dataset, outcomes: list[RequestOutcome],
                    duration: float, count_tokens=None, tokenizer_id: str | None = None) -> dict[str, Any]:
    """vLLM's result layout (setup keys, then the metrics), our additions, the full configuration, and the
    per-request arrays (dropped on save unless --save-detailed)."""
    selected = parse_metric_names(cfg.percentile_metrics or "ttft,tpot,itl")
    queue_metrics = [m for m in selected if m not in METRICS and cfg.max_concurrency is not None
                     and (m == "client_queue_time" or cfg.request_rate != float("inf"))]
    metrics, output_lens = compute_metrics(outcomes, duration, percentiles=parse_percentiles(cfg.metric_percentiles),
                                           goodput=parse_goodput(cfg.goodput), queue_metrics=queue_metrics,
                                           count_tokens=count_tokens)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": cfg.backend or cfg.backend_name,
        "backend": cfg.backend or cfg.backend_name, "label": cfg.label, "model_id": cfg.model or model,
        "tokenizer_id": tokenizer_id or cfg.tokenizer or cfg.model, "num_prompts": cfg.num_prompts,
    }
    for item in cfg.metadata or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
        result[key.strip()] = value.strip()
    result |= {"request_rate": cfg.request_rate if cfg.request_rate < float("inf") else "inf",
               "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency}
    if cfg.ramp_up_strategy is not None:
        result |= {"ramp_up_strategy": cfg.ramp_up_strategy, "ramp_up_start_rps": cfg.ramp_up_start_rps,
                   "ramp_up_end_rps": cfg.ramp_up_end_rps}
    result |= metrics
    result["rtfx"] = 0.0  # vLLM's real-time factor of audio transcription; always 0 for text generation
    result |= {"dataset_name": cfg.dataset_name, "served_model_name": model, "goodput_slos": parse_goodput(cfg.goodput),
               **data.info, "config": jsonable(dataclasses.asdict(cfg))}
    result |= {"input_lens": [o.prompt_len for o in outcomes], "output_lens": output_lens,
               "ttfts": [o.ttft for o in outcomes], "itls": [o.itl for o in outcomes],
               "latencies": [o.latency for o in outcomes], "start_times": [o.start_time for o in outcomes],
               "queue_times": [o.queue_time for o in outcomes],
               "generated_texts": [o.generated_text for o in outcomes], "errors": [o.error for o in outcomes]}
    failed = next((o.error for o in outcomes if not o.success), None)
    if failed:
        print(f"===== failed requests: {result['failed']}; first error: {failed} =====", file=sys.stderr)
    return result


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: ("inf" if v == float("inf") else v) for k, v in d.items()}


def result_path(cfg: ServeBenchConfig, result: dict[str, Any]) -> Path:
    """vLLM's file name `{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json` under --result-dir."""
    name = cfg.result_filename
    if name is None:
        base = str(result["model_id"]).rstrip("/").split("/")[-1]
        conc = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency is not None else ""
        name = f"{cfg.label or cfg.backend or cfg.backend_name}-{cfg.rate_label}{conc}-{base}-{result['date']}.json"
    return Path(cfg.result_dir or ".") / name


def save_result(cfg: ServeBenchConfig, result: dict[str, Any]) -> Path:
    """Write the JSON (per-request arrays only with --save-detailed), appended as one more line with
    --append-result, and, with --plots, the TTFT / ITL PNG."""
    path = result_path(cfg, result)
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = {k: v for k, v in result.items() if cfg.save_detailed or k not in DETAILED_KEYS}
    if cfg.append_result:
        with path.open("a", encoding="utf-8") as f:
            f.write(("\n" if f.tell() else "") + json.dumps(saved))  # vLLM's appended file: one object per line
    else:
        path.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"wrote {path}")
    if cfg.plots:
        from deltaserve.bench.plots import plot_distributions

        ok = [i for i, e in enumerate(result["errors"]) if not e]
        png = plot_distributions([result["ttfts"][i] * 1000 for i in ok],
                                 [g * 1000 for i in ok for g in result["itls"][i]], path.with_suffix(".png"),
                                 f"{cfg.dataset_name}, {result['served_model_name']}, rate {result['request_rate']}, "
                                 f"concurrency {cfg.max_concurrency}")
        print(f"wrote {png}")
    return path
