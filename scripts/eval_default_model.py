"""Acceptance measurements of the embedded default model (results go into `deltaserve/default_model/MODEL_CARD.md`).

1. Held-out code: next-token cross-entropy on standard-library files the model never saw, against the uniform
   baseline ln(vocab) and the held-out text's own unigram entropy.
2. Held-out tool tasks through a live `deltaserve serve` (started here without --model unless one is given) and the
   `openai` SDK, tool_choice "auto", no grammar: a parseable call of the right function with schema-valid arguments;
   then, with the tool result sent back, a final answer that contains the result. Plus held-out plain questions,
   which must be answered without a tool.

    python scripts/eval_default_model.py --tasks 120 --json /tmp/eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tool_data import TOOLS, Conversation, expected_in_answer, make_conversations, run_tool  # noqa: E402

from deltaserve.default_model import default_model_dir  # noqa: E402
from deltaserve.text.tokenizer import Tokenizer  # noqa: E402

API_KEY = "eval-key"


# ---------------------------------------------------------------- code cross-entropy
def code_cross_entropy(model_dir: Path, max_tokens: int, window: int) -> dict[str, float]:
    """Mean next-token cross-entropy (nats) of transformers' KimiLinearForCausalLM on held-out stdlib files."""
    from train_tiny import make_model_eval, stdlib_files

    tok = Tokenizer.from_pretrained(model_dir)
    stream: list[int] = []
    nbytes = 0
    for path in stdlib_files("heldout"):
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tok.encode(text, allow_special=False)
        take = ids[: max_tokens - len(stream)]
        nbytes += len(tok.decode(take).encode())
        stream += take
        if len(stream) >= max_tokens:
            break
    model = make_model_eval(model_dir)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(stream) - 1, window):
            chunk = torch.tensor([stream[start : start + window + 1]])
            if chunk.shape[1] < 2:
                break
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            total += loss.item()
            count += chunk.shape[1] - 1
    freq = Counter(stream)
    unigram = -sum(c / len(stream) * math.log(c / len(stream)) for c in freq.values())
    ce = total / count
    return {"tokens": count, "cross_entropy": ce, "uniform": math.log(tok.vocab_size), "unigram_entropy": unigram,
            "bits_per_byte": total / math.log(2) / nbytes}


# ---------------------------------------------------------------- live server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, log: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "deltaserve.entrypoints.cli", "serve", "--port", str(port), "--api-key", API_KEY,
           "--num-threads", str(threads)]
    if model:
        cmd += ["--model", model, "--served-model-name", "deltaserve-tiny-tools"]
    out = open(log, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not healthy in 300 s")


def _valid_args(name: str, args: Any) -> bool:
    """Arguments are a JSON object matching the tool's schema: required keys, no unknown keys, types, enums."""
    schema = next(t.parameters for t in TOOLS if t.name == name)
    if not isinstance(args, dict) or any(k not in args for k in schema["required"]):
        return False
    types = {"string": str, "number": (int, float)}
    for key, value in args.items():
        prop = schema["properties"].get(key)
        if prop is None or isinstance(value, bool) or not isinstance(value, types[prop["type"]]):
            return False
        if "enum" in prop and value not in prop["enum"]:
            return False
    return True


def _same_args(got: dict[str, Any], want: dict[str, Any]) -> bool:
    if set(got) != set(want):
        return False
    return all(float(got[k]) == float(want[k]) if isinstance(want[k], int | float) else got[k] == want[k]
               for k in want)


def run_task(client: Any, model: str, conv: Conversation, max_tokens: int) -> dict[str, Any]:
    """One held-out task through the server: the call turn, then (if the call is usable) the answer turn."""
    extra = {"chat_template_kwargs": {"thinking": conv.thinking}}
    tools = [t.to_openai() for t in TOOLS] if conv.offer_tools else None
    messages: list[dict[str, Any]] = [{"role": "user", "content": conv.user}]
    kw: dict[str, Any] = {"tools": tools, "tool_choice": "auto"} if tools else {}
    r1 = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                        extra_body=extra, **kw)
    msg = r1.choices[0].message
    rec: dict[str, Any] = {"user": conv.user, "expected_tool": conv.tool, "thinking": conv.thinking,
                           "content": msg.content, "tool_calls": [(c.function.name, c.function.arguments)
                                                                   for c in msg.tool_calls or ()]}
    if conv.tool is None:
        rec["no_call"] = not msg.tool_calls
        rec["answer_ok"] = rec["no_call"] and conv.answer.split(" is ")[-1].rstrip(".") in (msg.content or "")
        return rec
    call = (msg.tool_calls or [None])[0]
    rec["parsed"] = call is not None
    args = None
    if call is not None:
        try:
            args = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            args = None
    rec["right_name"] = call is not None and call.function.name == conv.tool
    rec["valid"] = rec["right_name"] and _valid_args(conv.tool, args)
    rec["exact_args"] = rec["valid"] and _same_args(args, conv.arguments)
    rec["answer_ok"] = False
    if not rec["valid"]:
        return rec
    try:
        result = run_tool(conv.tool, args)
    except (KeyError, ValueError, TypeError, ZeroDivisionError, SyntaxError) as exc:
        result = {"error": str(exc)}
    messages.append({"role": "assistant", "content": msg.content or "",
                     "tool_calls": [{"id": call.id, "type": "function",
                                     "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    r2 = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                        extra_body=extra, tools=tools, tool_choice="auto")
    answer = r2.choices[0].message.content or ""
    rec["answer"] = answer
    rec["answer_ok"] = "error" not in result and all(s in answer for s in expected_in_answer(conv.tool, result))
    return rec


def tool_eval(url: str, model: str, n: int, n_plain: int, seed: int, workers: int, max_tokens: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=600)
    tasks = [c for c in make_conversations("heldout", 4 * n, seed, plain_share=0.0)][:n]
    plain = [c for c in make_conversations("heldout", 20 * n_plain, seed + 1, plain_share=1.0)][:n_plain]
    t0 = time.time()
    with ThreadPoolExecutor(workers) as pool:
        recs = list(pool.map(lambda c: run_task(client, model, c, max_tokens), tasks + plain))
    tool_recs, plain_recs = recs[: len(tasks)], recs[len(tasks) :]

    def rate(key: str, rs: list[dict]) -> float:
        return sum(bool(r.get(key)) for r in rs) / max(1, len(rs))

    by_tool = {}
    for name in sorted({r["expected_tool"] for r in tool_recs}):
        rs = [r for r in tool_recs if r["expected_tool"] == name]
        by_tool[name] = {"n": len(rs), "valid_call": rate("valid", rs), "answer": rate("answer_ok", rs)}
    return {
        "tasks": len(tool_recs),
        "parseable_call": rate("parsed", tool_recs),
        "right_function": rate("right_name", tool_recs),
        "valid_call": rate("valid", tool_recs),
        "exact_arguments": rate("exact_args", tool_recs),
        "final_answer_with_result": rate("answer_ok", tool_recs),
        "thinking_tasks": sum(r["thinking"] for r in tool_recs),
        "valid_call_thinking": rate("valid", [r for r in tool_recs if r["thinking"]]),
        "valid_call_no_thinking": rate("valid", [r for r in tool_recs if not r["thinking"]]),
        "by_tool": by_tool,
        "plain_questions": len(plain_recs),
        "plain_no_call": rate("no_call", plain_recs),
        "plain_answer_correct": rate("answer_ok", plain_recs),
        "seconds": round(time.time() - t0),
        "records": recs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--tasks", type=int, default=120)
    ap.add_argument("--plain", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=8, help="concurrent requests")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--code-tokens", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads here and in the server")
    ap.add_argument("--skip-code", action="store_true")
    ap.add_argument("--skip-tools", action="store_true")
    ap.add_argument("--json", default=None, help="write the full results (with per-task records) here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir()
    results: dict[str, Any] = {"model": str(model_dir)}
    if not args.skip_code:
        results["code"] = code_cross_entropy(model_dir, args.code_tokens, 512)
        print("code:", json.dumps(results["code"]), flush=True)
    if not args.skip_tools:
        log = Path(tempfile.mkdtemp()) / "server.log"
        proc, url = start_server(args.model, log, args.threads)
        try:
            results["tools"] = tool_eval(url, "deltaserve-tiny-tools", args.tasks, args.plain, args.seed,
                                         args.workers, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        summary = {k: v for k, v in results["tools"].items() if k != "records"}
        print("tools:", json.dumps(summary, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
