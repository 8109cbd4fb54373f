"""Speculative decoding under load: `deltaserve bench sweep` against one server per configuration, side by side.

One `deltaserve serve` on the embedded model (one engine thread) per configuration (no speculation, n-gram, static
dspark k = 7, adaptive dspark k = 7), all started first; then, `--rounds` times, `bench sweep` at each concurrency
for each domain dataset (tool-chat, code-edit; outputs end at eos) against each server in turn, the order of the
servers reversed every other round so that drift on the machine falls on every configuration alike; prefix cache
flushed before every point. Each point's figures are the medians over the rounds (a run of one configuration moves
by ~10% from run to run on these machines; the rounds' own ratios against no-spec go into the table too). Writes
every point's JSON, a summary JSON, a markdown table and one plot (output tok/s and per-user decode p10 against
concurrency).

    python scripts/spec_sweep.py --out /tmp/spec-sweep --concurrencies 1,4,16,64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

CONFIGS = {
    "no-spec": None,
    "ngram k=3": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}',
    "dspark k=7 static": '{"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": false}',
    "dspark k=7 adaptive": '{"method": "dspark", "num_speculative_tokens": 7}',
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(spec: str | None, port: int, log: Path, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deltaserve.entrypoints.cli", "serve", "--port", str(port),
           "--num-threads", str(threads)]
    if spec is not None:
        cmd += ["--speculative-config", spec]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"server not ready in 600 s; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/spec-sweep")
    ap.add_argument("--concurrencies", default="1,4,16,64")
    ap.add_argument("--datasets", default="tool-chat,code-edit")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-concurrency", type=int, default=2)
    ap.add_argument("--min-num-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.configs.split(",")
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    rounds: dict[str, dict[str, list[list[dict]]]] = {}
    try:
        for name in names:
            port = free_port()
            print(f"== {name}: starting the server", flush=True)
            servers[name] = (start_server(CONFIGS[name], port, out / f"server_{tag_of(name)}.log", args.threads),
                             port)
        for r in range(args.rounds):
            for dataset in args.datasets.split(","):
                for name in names if r % 2 == 0 else names[::-1]:
                    points = run_sweep(args, servers[name][1], out / tag_of(name) / dataset / f"round{r}", dataset,
                                       out / f"bench_{tag_of(name)}_{dataset}_round{r}.log")
                    rounds.setdefault(name, {}).setdefault(dataset, []).append(points)
                    for p in points:
                        print(f"   round {r} {name} {dataset} c={p['max_concurrency']}: {p['output_throughput']:.1f} "
                              f"tok/s, p10 decode {p['p10_per_user_decode_tok_s']:.1f}, TTFT p90 "
                              f"{p['p90_ttft_ms']:.0f} ms, acceptance {p.get('spec_decode_acceptance_length')}",
                              flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    summary = {name: {dataset: median_points(runs) for dataset, runs in per.items()} for name, per in rounds.items()}
    (out / "summary.json").write_text(json.dumps({"medians": summary, "rounds": rounds}, indent=1) + "\n")
    write_table(summary, rounds, out / "table.md")
    plot(summary, out / "spec_sweep.png")


def tag_of(name: str) -> str:
    return name.replace(" ", "_").replace("=", "")


def run_sweep(args: argparse.Namespace, port: int, result_dir: Path, dataset: str, log: Path) -> list[dict]:
    """One `bench sweep` over every concurrency against the server on `port`; its points."""
    cmd = [sys.executable, "-m", "deltaserve.entrypoints.cli", "bench", "sweep",
           "--base-url", f"http://127.0.0.1:{port}", "--dataset-name", dataset,
           "--random-output-len", str(args.output_len), "--concurrencies", args.concurrencies,
           "--prompts-per-concurrency", str(args.prompts_per_concurrency),
           "--min-num-prompts", str(args.min_num_prompts), "--reset-prefix-cache", "--save-result",
           "--result-dir", str(result_dir), "--disable-tqdm", "--search-steps", "0"]
    print(f"   {dataset}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=log.open("w"), stderr=subprocess.STDOUT)
    summaries = sorted(result_dir.glob("sweep-*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(summaries[-1].read_text())["points"]


MEDIAN_KEYS = ("output_throughput", "p10_per_user_decode_tok_s", "p90_ttft_ms", "spec_decode_acceptance_length")


def median_points(runs: list[list[dict]]) -> list[dict]:
    """Per concurrency, the median over the rounds of each figure in MEDIAN_KEYS (None where a round has none)."""
    out = []
    for points in zip(*runs, strict=True):
        merged = {"max_concurrency": points[0]["max_concurrency"]}
        for key in MEDIAN_KEYS:
            values = [p[key] for p in points if p.get(key) is not None]
            merged[key] = statistics.median(values) if values else None
        out.append(merged)
    return out


def write_table(summary: dict[str, dict[str, list[dict]]], rounds: dict[str, dict[str, list[list[dict]]]],
                path: Path) -> None:
    lines = []
    datasets = sorted({d for per in summary.values() for d in per})
    for dataset in datasets:
        lines += [f"**{dataset}**", "", "| config | concurrency | output tok/s | vs no-spec | rounds vs no-spec | "
                  "per-user decode p10 | TTFT p90 (ms) | acceptance length |",
                  "|---|---:|---:|---:|---|---:|---:|---:|"]
        base = {p["max_concurrency"]: p["output_throughput"] for p in summary.get("no-spec", {}).get(dataset, [])}
        base_rounds = rounds.get("no-spec", {}).get(dataset, [])
        for name, per in summary.items():
            for i, p in enumerate(per.get(dataset, [])):
                c = p["max_concurrency"]
                ratio = f"{p['output_throughput'] / base[c]:.2f}x" if c in base and base[c] else "-"
                per_round = " ".join(f"{run[i]['output_throughput'] / b[i]['output_throughput']:.2f}"
                                     for run, b in zip(rounds[name][dataset], base_rounds, strict=False))
                acc = p.get("spec_decode_acceptance_length")
                lines.append(f"| {name} | {c} | {p['output_throughput']:.1f} | {ratio} | {per_round or '-'} | "
                             f"{p['p10_per_user_decode_tok_s']:.1f} | {p['p90_ttft_ms']:.0f} | "
                             f"{'-' if acc is None else f'{acc:.2f}'} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text())


def plot(summary: dict[str, dict[str, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({d for per in summary.values() for d in per})
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 8), squeeze=False)
    for col, dataset in enumerate(datasets):
        for name, per in summary.items():
            points = per.get(dataset, [])
            cs = [p["max_concurrency"] for p in points]
            axes[0][col].plot(cs, [p["output_throughput"] for p in points], marker="o", label=name)
            axes[1][col].plot(cs, [p["p10_per_user_decode_tok_s"] for p in points], marker="o", label=name)
        for row, label in ((0, "output tok/s"), (1, "per-user decode p10 (tok/s)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_title(dataset)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
