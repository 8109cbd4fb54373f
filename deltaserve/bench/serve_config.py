"""`ServeBenchConfig`: every option of `deltaserve bench serve`, with `vllm bench serve`'s flag names.

Each field is documented once (attribute docstring = `--help`); flags are `--field-name`, so `num_prompts` is
vLLM's `--num-prompts`. Field metadata carries what argparse needs beyond the type (nargs, choices, parser).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from deltaserve.bench.datasets import CHAT_DATASETS, DATASETS, DOMAIN_DATASETS, TOKEN_DATASETS
from deltaserve.bench.metrics import parse_goodput, parse_metric_names, parse_percentiles
from deltaserve.utils.cli_args import field_docs

BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
"""Backend name -> default endpoint, as in vLLM ("vllm" is vLLM's name for its own completions API)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeBenchConfig:
    """One `bench serve` run."""

    base_url: str | None = None
    """Server base URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)."""
    host: str = "127.0.0.1"
    """Server host when --base-url is not given."""
    port: int = 8000
    """Server port when --base-url is not given."""
    endpoint: str | None = None
    """API path (default: /v1/completions for backend openai, /v1/chat/completions for openai-chat)."""
    backend: str | None = field(default=None, metadata={"choices": list(BACKENDS)})
    """'openai' or 'vllm' (completions, token-id prompts), or 'openai-chat' (each prompt decoded into one user
    message; agentic sessions need it). Default: openai, and openai-chat for agentic."""
    model: str | None = None
    """Model id: a checkpoint directory or the served name (default: the first model of /v1/models)."""
    served_model_name: str | None = None
    """Model name sent in requests (default: --model when the server serves it, else the server's first model)."""
    tokenizer: str | None = None
    """Checkpoint directory with the tokenizer (default: --model when it is a directory, else the served model's
    directory, `root` in /v1/models, when it exists on this machine)."""
    header: list[str] | None = field(default=None, metadata={"nargs": "*"})
    """Extra request headers as KEY=VALUE. The API key comes from OPENAI_API_KEY (as in vLLM) or
    DELTASERVE_API_KEY."""
    insecure: bool = False
    """Do not verify the server's TLS certificate (https base URLs)."""
    trust_remote_code: bool = False
    """Accepted for `vllm bench serve` command lines (Kimi's need it there); no effect: tokenizers load without
    running a checkpoint's code."""
    ready_check_timeout_sec: int = 60
    """Seconds to wait for the server (GET /v1/models) before giving up; then one short test request (0: skip)."""
    dataset_name: str = field(default="random", metadata={"choices": list(DATASETS)})
    """Workload: random, prefix_repetition, mooncake (trace replay) or agentic (multi-turn chat with tools)."""
    dataset_path: str | None = None
    """Trace file for mooncake (default: the shared Mooncake conversation trace)."""
    num_prompts: int = 1000
    """Requests to send (turns, for agentic; trace rows, for mooncake)."""
    random_input_len: int = field(default=1024, metadata={"aliases": ["--input-len"]})
    """random: prompt tokens per request (after the prefix); vLLM's general --input-len sets it too."""
    random_output_len: int = field(default=128, metadata={"aliases": ["--output-len"]})
    """random: output tokens per request; vLLM's general --output-len sets it too."""
    random_range_ratio: float = 0.0
    """random: lengths uniform in [floor(len·(1 - r)), ceil(len·(1 + r))], r in [0, 1)."""
    random_prefix_len: int = 0
    """random: tokens of one random prefix shared by every prompt."""
    prefix_repetition_prefix_len: int = 256
    """prefix_repetition: tokens of each shared prefix."""
    prefix_repetition_suffix_len: int = 256
    """prefix_repetition: tokens of each request's own suffix."""
    prefix_repetition_num_prefixes: int = 10
    """prefix_repetition: distinct prefixes (requests are spread evenly over them)."""
    prefix_repetition_output_len: int = 128
    """prefix_repetition: output tokens per request."""
    trace_token_scale: int = 16
    """mooncake: divide token counts by this (a divisor of 512; 512-token hash blocks become 512/scale tokens)."""
    trace_time_scale: float = 1.0
    """mooncake: divide timestamps by this (2 = replay twice as fast)."""
    trace_select: str = field(default="head", metadata={"choices": ["head", "sessions"]})
    """mooncake: 'head' (first rows) or 'sessions' (whole conversations linked by >= 2 shared blocks)."""
    trace_max_output_len: int | None = None
    """mooncake: cap on scaled output lengths (default: half the server's max_model_len)."""
    self_timed: bool | None = None
    """Send requests at the trace's timestamps (default: on for mooncake) instead of --request-rate."""
    agentic_turns: int = 4
    """agentic: turns per session; each extends the previous context by the reply, a tool call and a result."""
    agentic_system_len: int = 512
    """agentic: tokens of the system prompt shared by all sessions."""
    agentic_user_len: int = 128
    """agentic: tokens of each session's task."""
    agentic_tool_len: int = 256
    """agentic: tokens of each tool result."""
    agentic_output_len: int = 64
    """agentic: output tokens per turn."""
    agentic_tool_latency: float = 0.0
    """agentic: seconds between a reply and the next turn (the tool's run time)."""
    request_rate: float = float("inf")
    """Requests (sessions, for agentic) per second; inf sends all at once."""
    burstiness: float = 1.0
    """Gamma shape of inter-arrival gaps: 1 is Poisson, < 1 burstier, > 1 more uniform."""
    ramp_up_strategy: str | None = field(default=None, metadata={"choices": ["linear", "exponential"]})
    """Raise the request rate from --ramp-up-start-rps to --ramp-up-end-rps over the run (instead of
    --request-rate): linearly or exponentially in the request index."""
    ramp_up_start_rps: int | None = None
    """Request rate of the first request, with --ramp-up-strategy."""
    ramp_up_end_rps: int | None = None
    """Request rate of the last request, with --ramp-up-strategy."""
    max_concurrency: int | None = None
    """Most requests (agentic: sessions) in flight at once, a client-side semaphore."""
    num_warmups: int = 0
    """Warm-up requests before the timed run (not counted)."""
    seed: int = 0
    """Seed of the prompts and the arrival times."""
    temperature: float = 0.0
    """Sampling temperature sent with every request (vLLM no longer defaults it; we send 0 unless told)."""
    top_p: float | None = None
    """Top-p sent with every request (default: not sent)."""
    top_k: int | None = None
    """Top-k sent with every request (default: not sent)."""
    min_p: float | None = None
    """Min-p sent with every request (default: not sent)."""
    frequency_penalty: float | None = None
    """Frequency penalty sent with every request (default: not sent)."""
    presence_penalty: float | None = None
    """Presence penalty sent with every request (default: not sent)."""
    repetition_penalty: float | None = None
    """Repetition penalty sent with every request (default: not sent)."""
    logprobs: int | None = None
    """Log-probabilities of this many top tokens returned per output token (default: none asked)."""
    ignore_eos: bool | None = None
    """Send ignore_eos so outputs have exactly the dataset's length (default: on, except for the domain datasets
    tool-chat and code-edit, whose outputs end at eos or --random-output-len)."""
    extra_body: dict[str, Any] | None = field(default=None, metadata={"type": json.loads})
    """JSON object merged into every request body."""
    percentile_metrics: str | None = None
    """Metrics printed with percentiles: ttft, tpot, itl, e2el, client_queue_time, e2el_including_client_queue
    (default: ttft,tpot,itl). The JSON always has ttft/tpot/itl/e2el."""
    metric_percentiles: str = "99"
    """Comma-separated percentiles to report, e.g. 50,90,99 (p90 and p99 are always in the JSON)."""
    goodput: list[str] | None = field(default=None, metadata={"nargs": "+"})
    """SLOs as KEY:VALUE in ms (ttft, tpot, e2el), e.g. --goodput ttft:500 tpot:50."""
    save_result: bool = False
    """Write the result JSON (and PNG plots beside it)."""
    save_detailed: bool = False
    """Add per-request arrays to the JSON (input_lens, output_lens, ttfts, itls, start_times, generated_texts,
    errors); latencies and queue_times are always saved, as in vLLM."""
    append_result: bool = False
    """Save the result (as --save-result) by appending it to the result file as one more JSON line, vLLM's
    format, instead of overwriting the file."""
    result_dir: str | None = None
    """Directory of the result files (default: the current directory)."""
    result_filename: str | None = None
    """Result file name (default: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json)."""
    label: str | None = None
    """Prefix of the result file name (default: the backend)."""
    metadata: list[str] | None = field(default=None, metadata={"nargs": "*"})
    """KEY=VALUE pairs stored in the result JSON."""
    plots: bool = True
    """With --save-result: also write TTFT and ITL distribution PNGs (needs matplotlib, the `bench` extra)."""
    disable_tqdm: bool = False
    """No progress line on stderr."""
    reset_prefix_cache: bool = False
    """POST /reset_prefix_cache before the run (deltaserve and vLLM both have it; forgets cached KV and state)."""

    def __post_init__(self) -> None:
        if self.dataset_name not in DATASETS:
            raise ValueError(f"unknown --dataset-name {self.dataset_name!r} (known: {', '.join(DATASETS)})")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be a positive integer, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        self._check_ramp_up()
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.dataset_name in CHAT_DATASETS and self.backend_name != "openai-chat":
            raise ValueError(f"--dataset-name {self.dataset_name} needs --backend openai-chat")
        if self.dataset_path is not None and self.dataset_name != "mooncake":
            raise ValueError(f"--dataset-path is a trace file for mooncake; --dataset-name {self.dataset_name} "
                             "generates its prompts")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"--logprobs must be >= 0, got {self.logprobs}")
        if self.agentic_turns < 1 or self.ready_check_timeout_sec < 0 or self.num_warmups < 0:
            raise ValueError("--agentic-turns must be >= 1, --ready-check-timeout-sec and --num-warmups >= 0")
        parse_goodput(self.goodput)
        parse_percentiles(self.metric_percentiles)
        parse_metric_names(self.percentile_metrics or "ttft,tpot,itl")

    def _check_ramp_up(self) -> None:
        """vLLM's rules: ramp-up replaces --request-rate and needs both ends, 0 < start <= end."""
        if self.ramp_up_strategy is None:
            if self.ramp_up_start_rps is not None or self.ramp_up_end_rps is not None:
                raise ValueError("--ramp-up-start-rps / --ramp-up-end-rps need --ramp-up-strategy")
            return
        start, end = self.ramp_up_start_rps, self.ramp_up_end_rps
        if self.ramp_up_strategy not in ("linear", "exponential"):
            raise ValueError(f"--ramp-up-strategy must be linear or exponential, got {self.ramp_up_strategy!r}")
        if self.uses_timestamps:
            raise ValueError("--ramp-up-strategy does not apply when requests are sent at trace timestamps "
                             "(add --no-self-timed)")
        if self.request_rate != float("inf"):
            raise ValueError("with --ramp-up-strategy the rate comes from --ramp-up-start-rps / --ramp-up-end-rps; "
                             "remove --request-rate")
        if start is None or end is None:
            raise ValueError("--ramp-up-strategy needs both --ramp-up-start-rps and --ramp-up-end-rps")
        if not 0 < start <= end:
            # vLLM allows a linear ramp from 0 and then fails on the first request's zero rate.
            raise ValueError(f"ramp-up rates must satisfy 0 < start <= end, got {start} and {end}")

    @property
    def sends_ignore_eos(self) -> bool:
        """The `ignore_eos` every request carries."""
        return self.dataset_name not in DOMAIN_DATASETS if self.ignore_eos is None else self.ignore_eos

    @property
    def backend_name(self) -> str:
        """'openai' (completions) or 'openai-chat': --backend ('vllm' is completions), else what the dataset needs
        (agentic sessions are chat)."""
        if self.backend is not None:
            return "openai" if self.backend == "vllm" else self.backend
        return "openai" if self.dataset_name in TOKEN_DATASETS else "openai-chat"

    @property
    def endpoint_path(self) -> str:
        return self.endpoint or BACKENDS[self.backend_name]

    @property
    def url(self) -> str:
        """Base URL without a trailing slash."""
        return (self.base_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def uses_timestamps(self) -> bool:
        """Send at trace timestamps (mooncake unless --no-self-timed) rather than by the arrival process."""
        return self.dataset_name == "mooncake" if self.self_timed is None else self.self_timed

    @property
    def chat(self) -> bool:
        return self.dataset_name in CHAT_DATASETS

    @property
    def ramp_up(self) -> tuple[str, float, float] | None:
        """(strategy, start, end requests/s) of the ramp-up, or None for a fixed --request-rate."""
        strategy, start, end = self.ramp_up_strategy, self.ramp_up_start_rps, self.ramp_up_end_rps
        if strategy is None or start is None or end is None:  # validated: all three or none
            return None
        return strategy, float(start), float(end)

    @property
    def rate_label(self) -> str:
        """The arrival rate in result file names, as vLLM writes it: `10.0qps`, `infqps`, or
        `ramp-up-linear-1qps-10qps`."""
        if self.ramp_up_strategy is not None:
            return f"ramp-up-{self.ramp_up_strategy}-{self.ramp_up_start_rps}qps-{self.ramp_up_end_rps}qps"
        return f"{self.request_rate}qps"


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    skip: tuple[str, ...] = ()) -> None:
    """One `--field-name` option per field of `cls` (help from the attribute docstrings, extras from metadata)."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        kind = typing.get_origin(kind) or kind
        shown = "inf" if f.default == float("inf") else f.default
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f"{docs.get(f.name, '')} "
                                  f"(default: {shown})".replace("%", "%%")}
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if "nargs" in f.metadata:
            kwargs["nargs"] = f.metadata["nargs"]
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        kwargs["type"] = f.metadata.get("type", str if kind in (list, dict) else kind)
        parser.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
