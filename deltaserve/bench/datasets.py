"""Workloads of `deltaserve bench serve`: random, prefix-sharing, Mooncake trace replay, multi-turn agentic sessions.

Token-id datasets (sent as `"prompt": [ids]` to /v1/completions, so lengths are exact) and chat sessions (sent to
/v1/chat/completions with tools). Mooncake replay reuses `trace_replay`'s loading and block mapping.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from deltaserve.bench import trace_replay as tr
from deltaserve.bench.spec_workloads import build_workload

if TYPE_CHECKING:
    from deltaserve.bench.serve_config import ServeBenchConfig
    from deltaserve.text.tokenizer import Tokenizer

DOMAIN_DATASETS = ("tool-chat", "code-edit")
"""Token-id prompts in the embedded model's own domains (`spec_workloads.py`), whose outputs end at eos: what
speculative decoding's acceptance depends on (tool calls and code copy; random prompts have nothing to find)."""
TOKEN_DATASETS = ("random", "prefix_repetition", "mooncake", *DOMAIN_DATASETS)
"""Datasets of token-id prompts (the `openai` backend, /v1/completions)."""
CHAT_DATASETS = ("agentic",)
"""Datasets of chat sessions (the `openai-chat` backend, /v1/chat/completions)."""
DATASETS = TOKEN_DATASETS + CHAT_DATASETS

AGENTIC_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "run_command", "description": "Run a shell command in the workspace and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
"""The tool every agentic session declares (its results are synthetic)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleRequest:
    """One token-id request."""

    prompt: list[int]
    prompt_len: int
    output_len: int
    arrival_s: float | None = None
    """Seconds after the first request (trace replay, scaled by the time scale); None: the arrival process decides."""
    hash_ids: tuple[int, ...] = ()
    """Mooncake only: ids of the prompt's scaled blocks (equal leading ids = equal prefixes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgenticSession:
    """One multi-turn agent conversation: turn k's prompt is turn k-1's plus its reply, a tool call and a result."""

    system: str
    """Shared by every session (a common prefix)."""
    user: str
    tool_results: tuple[str, ...]
    """One per turn after the first."""
    output_len: int

    @property
    def num_turns(self) -> int:
        return len(self.tool_results) + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Dataset:
    """A built workload: token-id requests or chat sessions (one of the two is empty)."""

    requests: list[SampleRequest]
    sessions: list[AgenticSession]
    info: dict[str, Any]
    """Dataset facts for the result JSON (e.g. the trace's theoretical prefix-hit rate)."""

    @property
    def num_requests(self) -> int:
        return len(self.requests) + sum(s.num_turns for s in self.sessions)


def ordinary_id_bound(tokenizer: Tokenizer) -> int:
    """Random prompt ids are drawn from [0, bound): below the first special token (Kimi's sit at the top)."""
    special = set(tokenizer.special_tokens.values()) | set(tokenizer.all_special_ids)
    return min(special | {tokenizer.vocab_size})


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> list[int]:
    """vLLM's random lengths: uniform integers in [floor(mean·(1 - r)), ceil(mean·(1 + r))], at least 1."""
    lo, hi = math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))
    return [max(1, int(x)) for x in rng.integers(lo, hi + 1, size=n)]


def random_requests(n: int, *, input_len: int, output_len: int, range_ratio: float = 0.0, prefix_len: int = 0,
                    id_bound: int, seed: int) -> list[SampleRequest]:
    """`random`: a shared prefix of `prefix_len` random ids, then `input_len` (± range_ratio) random ids each."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, id_bound, size=prefix_len).tolist()
    ins = _lengths(rng, n, input_len, range_ratio)
    outs = _lengths(rng, n, output_len, range_ratio)
    return [SampleRequest(prompt=prefix + rng.integers(0, id_bound, size=i).tolist(), prompt_len=prefix_len + i,
                          output_len=o) for i, o in zip(ins, outs, strict=True)]


def prefix_repetition_requests(n: int, *, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                               id_bound: int, seed: int) -> list[SampleRequest]:
    """`prefix_repetition` (vLLM's): `num_prefixes` random prefixes, each shared by n / num_prefixes requests
    that add their own random suffix; the requests are shuffled."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, id_bound, size=prefix_len).tolist() for _ in range(num_prefixes)]
    reqs = [SampleRequest(prompt=prefixes[i % num_prefixes] + rng.integers(0, id_bound, size=suffix_len).tolist(),
                          prompt_len=prefix_len + suffix_len, output_len=output_len) for i in range(n)]
    order = rng.permutation(n)
    return [reqs[i] for i in order]


def mooncake_requests(path: str, n: int, *, select: str, token_scale: int, time_scale: float,
                      max_output_len: int | None, max_model_len: int, id_bound: int,
                      seed: int) -> tuple[list[SampleRequest], dict[str, Any]]:
    """`mooncake`: the first n (or n of whole conversations, `select="sessions"`) trace rows, scaled.

    Token counts are divided by `token_scale` (512-token hash blocks become 512/token_scale tokens), each hash id
    maps to a fixed random block of ids (`trace_replay.build_prompts`), so equal ids give equal tokens and the
    trace's sharing structure is kept; arrival times are the timestamps divided by `time_scale`.
    """
    if token_scale < 1 or tr.TRACE_BLOCK_TOKENS % token_scale:
        raise ValueError(f"--trace-token-scale must divide {tr.TRACE_BLOCK_TOKENS}, got {token_scale}")
    if time_scale <= 0:
        raise ValueError(f"--trace-time-scale must be > 0, got {time_scale}")
    if select not in ("head", "sessions"):
        raise ValueError(f"--trace-select must be 'head' or 'sessions', got {select!r}")
    rows = tr.read_trace(path, n) if select == "head" else tr.select_sessions(tr.read_trace(path), n)
    cap = max_output_len if max_output_len is not None else max_model_len // 2
    trace = tr.scale_trace(rows, token_scale=token_scale, time_scale=time_scale, max_output_len=cap,
                           max_model_len=max_model_len)
    block_tokens = tr.TRACE_BLOCK_TOKENS // token_scale
    # build_prompts draws ids below vocab_size - 32; pass the bound so that no special token is drawn.
    prompts = tr.build_prompts(trace, block_tokens, id_bound + 32, seed)
    hits = tr.theoretical_hits(trace, block_tokens)
    total = sum(r.input_len for r in trace)
    info = {"trace": path, "trace_select": select, "trace_rows": len(rows), "trace_block_tokens": block_tokens,
            "trace_token_scale": token_scale, "trace_time_scale": time_scale,
            "trace_span_s": max((r.arrival_s for r in trace), default=0.0),
            "trace_theoretical_hit_tokens": sum(hits), "trace_theoretical_hit_rate": sum(hits) / max(1, total)}
    reqs = [SampleRequest(prompt=p, prompt_len=r.input_len, output_len=r.output_len, arrival_s=r.arrival_s,
                          hash_ids=r.hash_ids) for p, r in zip(prompts, trace, strict=True)]
    return reqs, info


class TextMaker:
    """Random text of about n tokens from pseudo-words whose token counts are known (exact for BPE that splits
    on spaces; the server's `usage.prompt_tokens` gives the real count anyway)."""

    SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "po", "se", "di", "fu", "ga", "he", "jo", "ki", "lu", "ma",
                 "no", "pe", "ri", "so", "tu", "va", "we", "yo", "za", "be", "co", "da", "fi", "gu")

    def __init__(self, tokenizer: Tokenizer, num_words: int = 512) -> None:
        rng = random.Random(0)
        self.words = sorted({"".join(rng.choices(self.SYLLABLES, k=rng.randint(1, 3))) for _ in range(num_words)})
        self.costs = [max(1, len(tokenizer.encode(" " + w, allow_special=False))) for w in self.words]

    def text(self, rng: random.Random, num_tokens: int) -> str:
        out: list[str] = []
        used = 0
        while used < num_tokens:
            i = rng.randrange(len(self.words))
            out.append(self.words[i])
            used += self.costs[i]
        return " ".join(out)


def agentic_sessions(num_requests: int, *, turns: int, system_len: int, user_len: int, tool_len: int,
                     output_len: int, tokenizer: Tokenizer, seed: int) -> list[AgenticSession]:
    """`agentic`: ceil(num_requests / turns) sessions (the last may be shorter) of `turns` turns each.

    All sessions share one system prompt; each has its own task and tool results (about `tool_len` tokens each).
    """
    maker = TextMaker(tokenizer)
    rng = random.Random(seed)
    system = "You are a coding agent. Use the run_command tool. Notes: " + maker.text(random.Random(-1), system_len)
    sessions = []
    left = num_requests
    while left > 0:
        k = min(turns, left)
        sessions.append(AgenticSession(system=system, user="Task: " + maker.text(rng, user_len),
                                       tool_results=tuple(maker.text(rng, tool_len) for _ in range(k - 1)),
                                       output_len=output_len))
        left -= k
    return sessions


def build_dataset(cfg: ServeBenchConfig, tokenizer: Tokenizer, *, max_model_len: int, seed: int,
                  model_dir: str = "") -> Dataset:
    """The workload `cfg.dataset_name` names, with `cfg.num_prompts` requests (turns for `agentic`). `model_dir`:
    the checkpoint the tokenizer came from (the domain datasets render its chat format)."""
    n, bound = cfg.num_prompts, ordinary_id_bound(tokenizer)
    if cfg.dataset_name in DOMAIN_DATASETS:
        work = build_workload(cfg.dataset_name, tokenizer, model_dir, n, seed)
        reqs = [SampleRequest(prompt=p, prompt_len=len(p), output_len=cfg.random_output_len) for p in work.prompts]
        return Dataset(requests=reqs, sessions=[], info={"sources": work.sources[:8]})
    if cfg.dataset_name == "random":
        reqs = random_requests(n, input_len=cfg.random_input_len, output_len=cfg.random_output_len,
                               range_ratio=cfg.random_range_ratio, prefix_len=cfg.random_prefix_len,
                               id_bound=bound, seed=seed)
        return Dataset(requests=reqs, sessions=[], info={})
    if cfg.dataset_name == "prefix_repetition":
        reqs = prefix_repetition_requests(n, prefix_len=cfg.prefix_repetition_prefix_len,
                                          suffix_len=cfg.prefix_repetition_suffix_len,
                                          num_prefixes=cfg.prefix_repetition_num_prefixes,
                                          output_len=cfg.prefix_repetition_output_len, id_bound=bound, seed=seed)
        return Dataset(requests=reqs, sessions=[], info={})
    if cfg.dataset_name == "mooncake":
        reqs, info = mooncake_requests(cfg.dataset_path or tr.DEFAULT_TRACE, n, select=cfg.trace_select,
                                       token_scale=cfg.trace_token_scale, time_scale=cfg.trace_time_scale,
                                       max_output_len=cfg.trace_max_output_len, max_model_len=max_model_len,
                                       id_bound=bound, seed=seed)
        return Dataset(requests=reqs, sessions=[], info=info)
    if cfg.dataset_name == "agentic":
        sessions = agentic_sessions(n, turns=cfg.agentic_turns, system_len=cfg.agentic_system_len,
                                    user_len=cfg.agentic_user_len, tool_len=cfg.agentic_tool_len,
                                    output_len=cfg.agentic_output_len, tokenizer=tokenizer, seed=seed)
        return Dataset(requests=[], sessions=sessions, info={"agentic_sessions": len(sessions)})
    raise ValueError(f"unknown --dataset-name {cfg.dataset_name!r} (known: {', '.join(DATASETS)})")
