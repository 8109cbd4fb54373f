"""`deltaserve bench sweep`: `bench serve` over a list of concurrencies, then an admission search.

Admission: the largest concurrency at which the per-user decode speed's p10 stays at or above a floor and TTFT p90
at or below a bound (with no failed request), found by bisecting between the largest passing and the smallest
failing concurrency of the sweep (latency is assumed to grow with concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench import serve, serve_result
from deltaserve.bench.serve_config import ServeBenchConfig, add_config_args, config_from_args

SUMMARY_KEYS = ("max_concurrency", "num_prompts", "completed", "failed", "duration", "request_throughput",
                "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "mean_per_user_decode_tok_s",
                "median_per_user_decode_tok_s", "p10_per_user_decode_tok_s", "prefix_cache_hit_rate",
                "spec_decode_acceptance_length")
"""Per-point keys kept in the sweep summary (each point's full result is its own `bench serve` JSON)."""
SKIPPED_SERVE_FIELDS = ("num_prompts", "max_concurrency", "result_filename")


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepConfig:
    """The sweep on top of the `bench serve` options."""

    concurrencies: str = "1,4,16"
    """Comma-separated --max-concurrency values to run, in any order."""
    prompts_per_concurrency: int = 4
    """Requests per point = max(this x concurrency, --min-num-prompts)."""
    min_num_prompts: int = 8
    """Fewest requests per point."""
    min_user_decode_tok_s: float | None = None
    """Admission: floor on the p10 of per-user decode speed (tok/s)."""
    max_ttft_p90_ms: float | None = None
    """Admission: bound on TTFT p90 (ms)."""
    search_steps: int = 3
    """Extra runs bisecting between the largest passing and the smallest failing concurrency."""

    def __post_init__(self) -> None:
        values = self.levels
        if not values or any(c < 1 for c in values):
            raise ValueError(f"--concurrencies {self.concurrencies!r}: expected positive integers, e.g. 1,4,16")
        if self.prompts_per_concurrency < 1 or self.min_num_prompts < 1 or self.search_steps < 0:
            raise ValueError("--prompts-per-concurrency and --min-num-prompts must be >= 1, --search-steps >= 0")

    @property
    def levels(self) -> list[int]:
        try:
            return sorted({int(c) for c in self.concurrencies.split(",") if c.strip()})
        except ValueError as exc:
            raise ValueError(f"--concurrencies {self.concurrencies!r}: expected positive integers") from exc

    @property
    def admission(self) -> bool:
        return self.min_user_decode_tok_s is not None or self.max_ttft_p90_ms is not None


def passes(point: dict[str, Any], sweep: SweepConfig) -> bool:
    """Whether a run meets the admission criteria (and lost no request)."""
    if point["failed"] or not point["completed"]:
        return False
    if sweep.min_user_decode_tok_s is not None and point["p10_per_user_decode_tok_s"] < sweep.min_user_decode_tok_s:
        return False
    return sweep.max_ttft_p90_ms is None or point["p90_ttft_ms"] <= sweep.max_ttft_p90_ms


def next_probe(results: dict[int, bool]) -> int | None:
    """The concurrency to try next: midway between the largest passing level (0 if none) and the smallest failing
    level above it; None when they are adjacent or nothing above the passing level failed."""
    lo = max((c for c, ok in results.items() if ok), default=0)
    hi = min((c for c, ok in results.items() if not ok and c > lo), default=None)
    if hi is None or hi - lo <= 1:
        return None
    return (lo + hi) // 2


def admitted(results: dict[int, bool]) -> dict[str, Any]:
    """The admission verdict: the largest passing concurrency below every failing one."""
    lo = max((c for c, ok in results.items() if ok), default=0)
    hi = min((c for c, ok in results.items() if not ok and c > lo), default=None)
    return {"max_admitted_concurrency": lo, "smallest_failing_concurrency": hi,
            "exact": hi is not None and hi - lo == 1, "upper_bound_tested": hi is not None}


def _point_config(base: ServeBenchConfig, sweep: SweepConfig, concurrency: int, index: int) -> ServeBenchConfig:
    # A new seed per round: with prefix caching on, a repeated prompt set would hit what an earlier round cached.
    return dataclasses.replace(base, max_concurrency=concurrency, seed=base.seed + index,
                               num_prompts=max(sweep.prompts_per_concurrency * concurrency, sweep.min_num_prompts))


async def run_sweep_async(base: ServeBenchConfig, sweep: SweepConfig) -> dict[str, Any]:
    points: list[dict[str, Any]] = []
    verdicts: dict[int, bool] = {}
    served: list[str] = []

    async def point(c: int) -> None:
        print(f"\n=== concurrency {c} (round {len(points) + 1}) ===", flush=True)
        result = await serve.run_async(_point_config(base, sweep, c, len(points)))
        served.append(result["served_model_name"])
        row = {k: result.get(k) for k in SUMMARY_KEYS}
        row["passes"] = passes(result, sweep) if sweep.admission else None
        points.append(row)
        verdicts[c] = bool(row["passes"])

    for c in sweep.levels:
        await point(c)
    search: dict[str, Any] | None = None
    if sweep.admission:
        for _ in range(sweep.search_steps):
            probe = next_probe(verdicts)
            if probe is None:
                break
            await point(probe)
        search = admitted(verdicts) | {"min_user_decode_tok_s": sweep.min_user_decode_tok_s,
                                       "max_ttft_p90_ms": sweep.max_ttft_p90_ms}
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "model_id": base.model or served[0],
            "served_model_name": served[0], "dataset_name": base.dataset_name,
            "points": sorted(points, key=lambda r: r["max_concurrency"]), "admission": search,
            "config": serve_result.jsonable(dataclasses.asdict(base)), "sweep": dataclasses.asdict(sweep)}


def format_sweep(summary: dict[str, Any]) -> str:
    header = (f"{'conc':>5} {'reqs':>5} {'req/s':>8} {'out tok/s':>10} {'TTFT p90':>10} {'TPOT med':>9} "
              f"{'user med':>9} {'user p10':>9} {'hit':>6} {'pass':>5}")
    lines = ["{s:{c}^{n}}".format(s=" Concurrency Sweep ", n=len(header), c="="), header]
    for r in summary["points"]:
        verdict = "" if r["passes"] is None else ("yes" if r["passes"] else "no")
        hit = "" if r["prefix_cache_hit_rate"] is None else f"{r['prefix_cache_hit_rate']:.0%}"
        lines.append(f"{r['max_concurrency']:>5} {r['completed']:>5} {r['request_throughput']:>8.2f} "
                     f"{r['output_throughput']:>10.1f} {r['p90_ttft_ms']:>10.1f} {r['median_tpot_ms']:>9.1f} "
                     f"{r['median_per_user_decode_tok_s']:>9.2f} {r['p10_per_user_decode_tok_s']:>9.2f} {hit:>6} "
                     f"{verdict:>5}")
    adm = summary["admission"]
    if adm is not None:
        bound = (f"(next tested, {adm['smallest_failing_concurrency']}, fails)" if adm["upper_bound_tested"]
                 else "(no tested concurrency failed: a lower bound)")
        criteria = ["no failed request"]
        if adm["min_user_decode_tok_s"] is not None:
            criteria.append(f"per-user decode p10 >= {adm['min_user_decode_tok_s']:g} tok/s")
        if adm["max_ttft_p90_ms"] is not None:
            criteria.append(f"TTFT p90 <= {adm['max_ttft_p90_ms']:g} ms")
        lines.append(f"admission: max concurrency {adm['max_admitted_concurrency']} {bound}; criteria: "
                     f"{', '.join(criteria)}")
    return "\n".join(lines)


def run_sweep(base: ServeBenchConfig, sweep: SweepConfig) -> dict[str, Any]:
    summary = asyncio.run(run_sweep_async(base, sweep))
    print("\n" + format_sweep(summary))
    if base.save_result:
        model = str(summary["model_id"]).rstrip("/").split("/")[-1]
        path = Path(base.result_dir or ".") / f"{base.label or 'sweep'}-{base.dataset_name}-{model}-{summary['date']}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {path.with_suffix('.json')}")
        if base.plots:
            from deltaserve.bench.plots import plot_sweep

            png = plot_sweep(summary["points"], path.with_suffix(".png"), f"{base.dataset_name} sweep, {model}",
                             sweep.min_user_decode_tok_s)
            print(f"wrote {png}")
    return summary


def _main(ns: argparse.Namespace) -> int:
    serve.quiet_http_logs()
    fixed: dict[str, Any] = {"num_prompts": 1, "max_concurrency": None, "result_filename": None}  # set per point
    base = ServeBenchConfig(**{f.name: fixed[f.name] if f.name in fixed else getattr(ns, f.name)
                               for f in dataclasses.fields(ServeBenchConfig)})
    summary = run_sweep(base, config_from_args(SweepConfig, ns))
    return 0 if all(p["completed"] for p in summary["points"]) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `sweep` under `deltaserve bench`."""
    p = sub.add_parser("sweep", help="bench serve over a concurrency sweep, then an admission search",
                       description=__doc__.splitlines()[0])
    add_config_args(p.add_argument_group("sweep"), SweepConfig)
    add_config_args(p.add_argument_group("per-run options (as bench serve)"), ServeBenchConfig,
                    skip=SKIPPED_SERVE_FIELDS)
    p.set_defaults(func=_main)
