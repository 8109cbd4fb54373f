"""PNG plots of serving benchmarks (matplotlib, the optional `bench` extra; Agg backend, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'deltaserve[bench]' (or --no-plots)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_distributions(ttfts_ms: Sequence[float], itls_ms: Sequence[float], path: str | Path, title: str) -> Path:
    """Histograms of TTFT (per request) and ITL (every gap) side by side, with p50 / p90 / p99 marked."""
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, values, name in ((axes[0], ttfts_ms, "TTFT"), (axes[1], itls_ms, "ITL")):
        data = list(values) or [0.0]
        ax.hist(data, bins=min(50, max(5, len(data) // 4)), color="#4C72B0", alpha=0.85)
        for p, style in ((50, "-"), (90, "--"), (99, ":")):
            v = float(np.percentile(data, p))
            ax.axvline(v, color="#C44E52", linestyle=style, label=f"p{p} {v:.1f} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests" if name == "TTFT" else "gaps")
        ax.set_title(f"{name} distribution (n={len(values)})")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_sweep(points: Sequence[dict[str, Any]], path: str | Path, title: str,
               min_user_decode: float | None = None) -> Path:
    """Output throughput against per-user decode speed across a sweep (one point per concurrency), and TTFT p90
    against concurrency. The decode axis shows the median with the p10 as the error bar's low end."""
    plt = _pyplot()
    pts = sorted(points, key=lambda r: r["max_concurrency"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    med = [r["median_per_user_decode_tok_s"] for r in pts]
    p10 = [r["p10_per_user_decode_tok_s"] for r in pts]
    tput = [r["output_throughput"] for r in pts]
    left.errorbar(med, tput, xerr=[[m - p for m, p in zip(med, p10, strict=True)], [0] * len(pts)], fmt="o-",
                  color="#4C72B0", ecolor="#8DA0CB", capsize=3)
    for r, x, y in zip(pts, med, tput, strict=True):
        left.annotate(f"c={r['max_concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if min_user_decode is not None:
        left.axvline(min_user_decode, color="#C44E52", linestyle="--", label=f"floor {min_user_decode:g} tok/s")
        left.legend(fontsize=8)
    left.set_xlabel("per-user decode speed, median (bar to p10) (tok/s)")
    left.set_ylabel("output throughput (tok/s)")
    left.set_title("throughput vs per-user speed")
    levels = [r["max_concurrency"] for r in pts]
    right.plot(levels, [r["p90_ttft_ms"] for r in pts], "o-", color="#55A868")
    right.set_xscale("log", base=2)
    right.set_xticks(levels, [str(c) for c in levels])
    right.minorticks_off()
    right.set_xlabel("concurrency")
    right.set_ylabel("TTFT p90 (ms)")
    right.set_title("TTFT p90 vs concurrency")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
