"""The `deltaserve` command: `serve`, `generate`, `make-tiny`, `quantize`, `router`, `serve-disagg` and `bench`.

This module is the composition root of the command line, so it may import any layer (lazily, per subcommand).
"""

from __future__ import annotations

import argparse
import logging
import sys

from deltaserve.engine.client import EngineStartError


def _generate(args: argparse.Namespace) -> int:
    import dataclasses

    from deltaserve.config import CacheConfig, SchedulerConfig
    from deltaserve.entrypoints.llm import LLM
    from deltaserve.sampling_params import SamplingParams

    engine_args = {f.name: getattr(args, f.name) for cls in (CacheConfig, SchedulerConfig)
                   for f in dataclasses.fields(cls)}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, device=args.device,
              speculative_config=args.speculative_config, enforce_eager=args.enforce_eager,
              cuda_graph_sizes=args.cuda_graph_sizes, max_seq_len_to_capture=args.max_seq_len_to_capture,
              **engine_args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    out = llm.generate(args.prompt, params)[0].outputs[0]
    print(out.text)
    logging.getLogger("deltaserve").info("%d tokens, finish_reason=%s", len(out.token_ids), out.finish_reason)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from deltaserve import envs
    from deltaserve.config import (
        CacheConfig,
        EngineConfig,
        KVTransferConfig,
        ParallelConfig,
        SchedulerConfig,
        ServerConfig,
        SpeculativeConfig,
    )
    from deltaserve.entrypoints.server.launch import run
    from deltaserve.utils.cli_args import dataclass_from_args
    from deltaserve.utils.cpu_threads import default_num_threads

    server = dataclass_from_args(ServerConfig, args)
    spec = SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config is not None else None
    kv = KVTransferConfig.from_json(args.kv_transfer_config) if args.kv_transfer_config is not None else None
    model = args.model
    if model is None:  # the embedded default model
        import dataclasses

        from deltaserve.default_model import DEFAULT_MODEL_NAME, default_model_dir

        model = str(default_model_dir())
        if server.served_model_name is None:
            server = dataclasses.replace(server, served_model_name=DEFAULT_MODEL_NAME)
    if server.api_key is None and envs.api_key():
        import dataclasses

        server = dataclasses.replace(server, api_key=envs.api_key())
    engine = EngineConfig(model=model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
                          device=args.device, enforce_eager=args.enforce_eager,
                          cuda_graph_sizes=None if args.cuda_graph_sizes is None else tuple(args.cuda_graph_sizes),
                          max_seq_len_to_capture=args.max_seq_len_to_capture,
                          structured_output_backend=args.structured_output_backend,
                          # The API process keeps a core of its own (utils/cpu_threads.py).
                          num_threads=args.num_threads if args.num_threads is not None or args.device != "cpu"
                          else default_num_threads(reserved=1),
                          cache=dataclass_from_args(CacheConfig, args),
                          scheduler=dataclass_from_args(SchedulerConfig, args),
                          parallel=dataclass_from_args(ParallelConfig, args), speculative_config=spec,
                          kv_transfer_config=kv)
    if server.restart_engine and engine.parallel.experts_span_replicas:
        raise ValueError("--restart-engine cannot be used with experts over data-parallel replicas "
                         "(--data-parallel-size N --enable-expert-parallel): the replicas live and die together, "
                         "and one restarted alone cannot rejoin the others")
    return run(engine, server, log_level=args.log_level)


def _make_tiny(args: argparse.Namespace) -> int:
    from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint
    from deltaserve.utils.cli_args import dataclass_from_args

    spec = dataclass_from_args(TinySpec, args)
    out = write_tiny_checkpoint(args.out_dir, spec)
    print(f"wrote a tiny {'Kimi K3' if spec.arch == 'kimi_k3' else 'Kimi Linear'} checkpoint to {out}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from deltaserve.models.quantize import quantize_checkpoint

    out = quantize_checkpoint(args.src, args.dst)
    print(f"wrote {out} with MXFP4 routed experts (compressed-tensors mxfp4-pack-quantized)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from deltaserve.bench import (
        cpu,
        disagg,
        executor_overhead,
        followup,
        http_overhead,
        memory_plan,
        offline,
        parallel,
        serve,
        spec,
        sweep,
        trace_replay,
        vision,
    )
    from deltaserve.config import CacheConfig, MediaConfig, ParallelConfig, SchedulerConfig, ServerConfig
    from deltaserve.entrypoints.router import commands as router_commands
    from deltaserve.models.tiny_spec import TinySpec
    from deltaserve.utils.cli_args import add_dataclass_args

    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    srv.add_argument("--model", default=None,
                     help="checkpoint directory (default: the embedded model, deltaserve/default_model)")
    srv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    srv.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    srv.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling (default: 0)")
    srv.add_argument("--device", default="cpu", help="'cpu', 'cuda' or 'cuda:N' (default: cpu)")
    srv.add_argument("--num-threads", type=int, default=None,
                     help="torch threads of the engine process (default on CPU: the cores of its affinity mask "
                          "less one for the API process; pin with taskset / numactl)")
    srv.add_argument("--structured-output-backend", default="llguidance", choices=["llguidance", "xgrammar"],
                     help="grammar library for response_format and forced tool calls (default: llguidance)")
    srv.add_argument("--trust-remote-code", action="store_true",
                     help="accepted for `vllm serve` command lines (Kimi's need it there); no effect: deltaserve "
                          "implements the models and never runs a checkpoint's code")
    _add_graph_args(srv)
    add_dataclass_args(srv.add_argument_group("server"), ServerConfig)
    add_dataclass_args(srv.add_argument_group("images"), MediaConfig)
    engine = srv.add_argument_group("engine (help generated from the config dataclasses)")
    add_dataclass_args(engine, CacheConfig, aliases={"enable_prefix_caching": "prefix-caching"})
    add_dataclass_args(engine, SchedulerConfig)
    add_dataclass_args(engine, ParallelConfig)
    _add_speculative_arg(engine, kv_transfer=True)
    srv.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("--model", default=None,
                     help="checkpoint directory (default: the embedded model, deltaserve/default_model)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (or below 1e-5) is greedy (default: 0)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    gen.add_argument("--device", default="cpu", help="'cpu', 'cuda' or 'cuda:N' (default: cpu)")
    _add_graph_args(gen)
    engine = gen.add_argument_group("engine (help generated from the config dataclasses)")
    add_dataclass_args(engine, CacheConfig, aliases={"enable_prefix_caching": "prefix-caching"})
    add_dataclass_args(engine, SchedulerConfig)
    _add_speculative_arg(engine)
    gen.set_defaults(func=_generate)

    tiny = sub.add_parser("make-tiny", help="write a tiny random Kimi Linear or Kimi K3 checkpoint (no network needed)")
    tiny.add_argument("out_dir", help="output directory")
    add_dataclass_args(tiny, TinySpec, aliases={"top_k": "top-k"})
    tiny.set_defaults(func=_make_tiny)

    quant = sub.add_parser("quantize", help="copy a Kimi K3 checkpoint with its routed experts in MXFP4")
    quant.add_argument("src", help="K3 checkpoint directory with unquantised routed experts")
    quant.add_argument("dst", help="output directory")
    quant.set_defaults(func=_quantize)

    router_commands.add_parsers(sub)  # `router` and `serve-disagg` (prefill/decode disaggregation)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for module in (offline, trace_replay, followup, http_overhead, executor_overhead, parallel, memory_plan, serve,
                   sweep, spec, cpu, disagg, vision):
        module.add_parser(bench_sub)
    return parser


def _add_graph_args(parser: argparse.ArgumentParser) -> None:
    """--enforce-eager and --cuda-graph-sizes (vLLM's names; `EngineConfig` documents them)."""
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never capture CUDA graphs nor compile the dspark drafter's CPU graphs (the target's "
                             "CPU steps are eager anyway: torch.compile measured slower than the hand-fused CPU ops, "
                             "see docs/benchmarks.md)")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                        help="decode batch sizes captured as CUDA graphs on a GPU (default: 1 2 4 and every multiple "
                             "of 8 up to --max-num-seqs, at most 512)")
    parser.add_argument("--max-seq-len-to-capture", type=int, default=8192, metavar="N",
                        help="longest sequence a decode graph covers; steps with a longer one run eagerly (default: "
                             "8192)")


def _add_kv_transfer_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                       help='prefill/decode disaggregation, vLLM\'s JSON keys: kv_connector ("shm" (default: shared '
                            'memory on one host, TCP between hosts), "tcp", "nixl", "mooncake"), kv_role '
                            '("kv_producer", "kv_consumer", "kv_both"), kv_ip, kv_port, kv_buffer_size, '
                            'transfer_timeout_s, transfer_ttl_s, e.g. \'{"kv_role": "kv_producer"}\' (default: none)')


def _add_speculative_arg(group: argparse._ArgumentGroup, *, kv_transfer: bool = False) -> None:
    """--speculative-config, and with `kv_transfer` --kv-transfer-config."""
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, vLLM\'s JSON keys: method ("ngram" or "draft_model"), '
                            "num_speculative_tokens (1..16), prompt_lookup_min / prompt_lookup_max (ngram; default "
                            "5), model and draft_sample_method (draft_model), e.g. "
                            '\'{"method": "ngram", "num_speculative_tokens": 3}\' (default: none)')
    if kv_transfer:
        _add_kv_transfer_arg(group)


def main(argv: list[str] | None = None) -> int:
    from deltaserve.utils.cli_args import dashes_in_flags

    args = build_parser().parse_args(dashes_in_flags(sys.argv[1:] if argv is None else list(argv)))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, OSError, EngineStartError) as exc:  # bad input or environment: one line, no traceback
        print(f"deltaserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
