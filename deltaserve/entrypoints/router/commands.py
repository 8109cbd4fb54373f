"""The `router` and `serve-disagg` subcommands: `add_parsers` registers them on the `deltaserve` command line;
`main(argv)` runs them alone (`python -m deltaserve.entrypoints.router.commands router --decode URL ...`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from deltaserve.entrypoints.router.config import RouterTimeouts
from deltaserve.utils.cli_args import add_dataclass_args, dataclass_from_args, field_docs

_ROUTER_HELP = "prefill/decode disaggregation router in front of `deltaserve serve` instances"
_DISAGG_HELP = ("start prefill and decode instances of one model on this machine and serve a router in front of "
                "them; options not listed here go unchanged to every `deltaserve serve` instance")


class _ForwardingParser(argparse.ArgumentParser):
    """A subcommand parser that keeps the options it does not know in `serve_args` instead of refusing them (the
    options of `deltaserve serve`, passed through to every instance)."""

    def parse_known_args(  # type: ignore[override]
            self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.serve_args = [*getattr(parsed, "serve_args", []), *extras]
        return parsed, []


def add_parsers(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `router` and `serve-disagg` on the `deltaserve` subcommands."""
    router = subparsers.add_parser("router", help=_ROUTER_HELP, description=_ROUTER_HELP)
    router.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="base URL of a prefill instance (repeat for several; none: decode instances prefill)")
    router.add_argument("--decode", action="append", default=[], metavar="URL", required=True,
                        help="base URL of a decode instance (repeat for several)")
    router.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    router.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    add_dataclass_args(router.add_argument_group("instances (help from RouterTimeouts)"), RouterTimeouts)
    router.set_defaults(func=_run_router)

    # No abbreviations: an instance option that begins like one of ours must reach the instances whole.
    disagg = subparsers.add_parser("serve-disagg", help=_DISAGG_HELP, description=_DISAGG_HELP, allow_abbrev=False)
    disagg.__class__ = _ForwardingParser  # argparse builds subcommand parsers itself; only this one forwards
    disagg.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    disagg.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill instances (default: 1)")
    disagg.add_argument("--decode", type=int, default=1, metavar="M", help="decode instances (default: 1)")
    disagg.add_argument("--host", default="127.0.0.1", help="address the router listens on (default: 127.0.0.1)")
    disagg.add_argument("--port", type=int, default=8000, help="port the router listens on (default: 8000)")
    disagg.add_argument("--kv-connector", default=None,
                        help="KV transfer backend of every instance (the kv_connector of --kv-transfer-config; "
                             "default: the engine's)")
    disagg.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help="further kv-transfer-config keys for every instance (kv_role is set per instance)")
    disagg.add_argument("--startup-timeout-s", type=float, default=600.0,
                        help="longest wait for every instance's /health (default: 600)")
    disagg.add_argument("--shutdown-grace-s", type=float, default=40.0,
                        help="how long a stopping instance gets before it is killed (default: 40)")
    # The router's other timeouts keep their defaults: `--health-timeout-s` is an instance option (ServerConfig).
    default_interval = RouterTimeouts().health_interval_s
    disagg.add_argument("--health-interval-s", type=float, default=default_interval,
                        help=f"{field_docs(RouterTimeouts)['health_interval_s']} (default: {default_interval})")
    disagg.set_defaults(func=_run_serve_disagg, serve_args=[])


def _run_router(args: argparse.Namespace) -> int:
    from deltaserve.entrypoints.router.app import run_router
    from deltaserve.entrypoints.router.config import RouterConfig

    config = RouterConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), host=args.host,
                          port=args.port, timeouts=dataclass_from_args(RouterTimeouts, args))
    return run_router(config, _log_level(args))


def _run_serve_disagg(args: argparse.Namespace) -> int:
    from deltaserve.entrypoints.router.launcher import DisaggPlan, serve_disagg

    kv: dict[str, Any] = {}
    if args.kv_transfer_config is not None:
        try:
            kv = json.loads(args.kv_transfer_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"serve-disagg: --kv-transfer-config is not valid JSON: {exc}") from None
        if not isinstance(kv, dict):
            raise ValueError("serve-disagg: --kv-transfer-config must be a JSON object")
    if args.kv_connector is not None:
        kv["kv_connector"] = args.kv_connector
    plan = DisaggPlan(model=args.model, num_prefill=args.prefill, num_decode=args.decode, host=args.host,
                      port=args.port, kv_transfer_config=kv, serve_args=tuple(args.serve_args),
                      startup_timeout_s=args.startup_timeout_s, shutdown_grace_s=args.shutdown_grace_s,
                      timeouts=RouterTimeouts(health_interval_s=args.health_interval_s))
    return serve_disagg(plan, _log_level(args))


def _log_level(args: argparse.Namespace) -> str:
    return str(getattr(args, "log_level", "INFO"))


def main(argv: list[str] | None = None) -> int:
    """`router ...` or `serve-disagg ...` without the rest of the `deltaserve` command line."""
    parser = argparse.ArgumentParser(prog="deltaserve", description="disaggregated serving")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return int(args.func(args))
    except (ValueError, OSError) as exc:  # bad input or environment (an instance that failed): one line
        print(f"deltaserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
