"""Speculative decoding with the embedded draft model (`deltaserve/default_model/draft/`), on the embedded model's
own domain: held-out tool-use chats (scripts/make_tool_data.py's held-out split, as scripts/eval_default_model.py),
rendered with its chat format up to each assistant turn (the tool call; the answer after the tool result).

1. Acceptance (greedy, k drafts): mean accepted drafts per verified step and the acceptance rate, from the engine's
   counters (`EngineStats.spec_*`), over a batch of prompts.
2. Single-stream speed: each prompt alone through `LLM.generate`, greedy, with and without the draft, in one
   process with alternating runs; output tokens per second of each and their ratio, plus where a speculative
   step's time goes (draft proposals vs the rest of the step).

    python scripts/measure_draft_model.py --prompts 24 --k 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tool_data import TOOLS, make_conversations, messages_of  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.chat import get_chat_format  # noqa: E402
from deltaserve.default_model import DRAFT_PATH, default_model_dir  # noqa: E402
from deltaserve.text.tokenizer import Tokenizer  # noqa: E402


def domain_prompts(n: int, seed: int) -> list[list[int]]:
    """Token ids of `n` generation prompts from held-out tool tasks (as scripts/eval_default_model.py): the history
    up to each assistant turn (the tool call, then the answer after the tool result)."""
    model_dir = default_model_dir()
    fmt = get_chat_format(model_dir, Tokenizer.from_pretrained(model_dir))
    out = []
    for conv in make_conversations("heldout", n, seed, plain_share=0.0):
        msgs = messages_of(conv)
        for t in (t for t, m in enumerate(msgs) if m.role == "assistant"):
            out.append(list(fmt.render(msgs[:t], tools=TOOLS if conv.offer_tools else (), thinking=conv.thinking,
                                       add_generation_prompt=True)))
    return out[:n]


class Timed:
    """Wraps the engine's proposer: counts the seconds spent proposing."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.seconds = inner, 0.0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def propose(self, requests):  # noqa: ANN001, ANN201
        start = time.perf_counter()
        try:
            return self.inner.propose(requests)
        finally:
            self.seconds += time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="alternating plain / speculative passes over the prompts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--draft", default=str(DRAFT_PATH))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = domain_prompts(args.prompts, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    spec = {"method": "draft_model", "num_speculative_tokens": args.k, "model": args.draft,
            "draft_sample_method": "greedy"}
    plain, fast = LLM(), LLM(speculative_config=spec)
    hook = next(h for h in fast.engine.hooks if hasattr(h, "proposer"))
    hook.proposer = timed = Timed(hook.proposer)

    # 1. acceptance over one batch (the draft sees the same tokens as alone: greedy outputs are unchanged)
    batch_plain = plain.generate(prompts, params)
    batch_fast = fast.generate(prompts, params)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(batch_plain, batch_fast, strict=True))
    stats = fast.engine.get_stats()
    drafts, draft_tokens, accepted = stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    print(f"batch of {len(prompts)}: identical outputs {same}/{len(prompts)}; {drafts} verified steps, "
          f"{draft_tokens} draft tokens, {accepted} accepted: rate {accepted / max(draft_tokens, 1):.3f}, "
          f"mean accepted per step {accepted / max(drafts, 1):.2f} (of up to {args.k})", flush=True)

    # 2. single stream, alternating
    times: dict[str, list[float]] = {"plain": [], "spec": []}
    tokens: dict[str, int] = {"plain": 0, "spec": 0}
    propose_s = step_s = 0.0
    steps = 0
    for _ in range(args.rounds):
        for name, llm in (("plain", plain), ("spec", fast)):
            total = 0.0
            before = (timed.seconds, llm.engine.stats.total_seconds, llm.engine.stats.steps)
            for p in prompts:
                start = time.perf_counter()
                out = llm.generate([p], params)[0]
                total += time.perf_counter() - start
                tokens[name] += len(out.outputs[0].token_ids)
            times[name].append(total)
            if name == "spec":
                propose_s += timed.seconds - before[0]
                step_s += llm.engine.stats.total_seconds - before[1]
                steps += llm.engine.stats.steps - before[2]
            print(f"{name}: {total:.2f} s", flush=True)
    rate = {n: tokens[n] / sum(times[n]) for n in times}
    print(f"single stream: plain {rate['plain']:.1f} tok/s, speculative {rate['spec']:.1f} tok/s, "
          f"ratio {rate['spec'] / rate['plain']:.2f}x", flush=True)
    print(f"speculative steps: {steps}, {1e3 * step_s / max(steps, 1):.2f} ms per step, of which proposing "
          f"{1e3 * propose_s / max(steps, 1):.2f} ms ({propose_s / max(step_s, 1e-9):.0%})", flush=True)
    plain_steps = plain.engine.stats
    print(f"plain steps: {plain_steps.steps}, {1e3 * plain_steps.total_seconds / max(plain_steps.steps, 1):.2f} ms "
          f"per step (all runs)", flush=True)
    result = {"prompts": len(prompts), "k": args.k, "identical": same, "verified_steps": drafts,
              "draft_tokens": draft_tokens, "accepted": accepted, "tok_s": rate,
              "ratio": rate["spec"] / rate["plain"], "times": times, "median_plain": statistics.median(times["plain"]),
              "propose_share": propose_s / max(step_s, 1e-9)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
