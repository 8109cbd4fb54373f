"""The import-direction rule of DESIGN.md: every deltaserve module imports only from layers below its own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "deltaserve"

# What each top-level part may import (besides itself). Lower layers first; see docs/structure.md.
BASE = {"config", "sampling_params", "outputs", "request", "envs", "utils", "text", "parsers", "chat", "default_model",
        "multimodal"}
ALLOWED: dict[str, set[str]] = {
    **{name: BASE for name in BASE},
    "ops": {"envs", "utils"},
    "distributed": BASE,
    "cache": BASE,
    "kvstore": BASE,  # the shared KV store (L3): no torch
    "kvtransfer": BASE | {"kvstore"},  # P/D transports (no torch); entry framing from kvstore
    "scheduler": BASE | {"cache", "kvstore"},  # kvstore: the store counters a step reports (no torch)
    "layers": BASE | {"ops", "distributed"},
    "models": BASE | {"ops", "layers", "cache", "distributed"},
    "structured": BASE,
    "runner": BASE | {"ops", "layers", "models", "cache", "scheduler", "structured", "distributed", "kvstore",
               "kvtransfer"},
    "spec_decode": BASE | {"ops", "layers", "models", "cache", "scheduler", "runner", "distributed"},
    "disagg": BASE | {"cache", "scheduler", "runner"},
    "executor": BASE | {"ops", "layers", "models", "cache", "scheduler", "runner", "distributed", "kvstore",
                 "kvtransfer"},
    "engine": BASE | {"cache", "scheduler", "spec_decode", "disagg", "structured", "executor", "kvstore",
               "kvtransfer"},
    "entrypoints": BASE | {"engine", "structured"},
    # models: to write a tiny checkpoint when none is given; layers, cache: the roofline reads the loaded model's
    # expert modules and cache specs; scheduler: the step observer's SchedulerOutput type.
    "bench": BASE | {"engine", "entrypoints", "models", "layers", "cache", "scheduler", "executor", "distributed"},
}
# Composition roots may import anything: the package facade and the command line.
ROOTS = {"deltaserve/__init__.py", "deltaserve/entrypoints/cli.py"}
ALLOWED["utils"] = set()
ALLOWED["default_model"] = set()  # package data and its path only


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "deltaserve" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def test_imports_go_downward_only():
    """No module imports from its own layer's superiors or siblings (an upward or sideways edge)."""
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel in ROOTS:
            continue
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        assert own in ALLOWED, f"{rel}: top-level part {own!r} has no place in the layering table"
        for module in _imports(path):
            target = _part(module)
            if target is None or target == own:
                continue
            if target not in ALLOWED[own]:
                violations.append(f"{rel} imports {module} ({own} -> {target})")
    assert not violations, "upward or sideways imports:\n" + "\n".join(violations)


def test_layering_table_catches_an_upward_edge(tmp_path):
    """The checker itself fails on a module that imports upward (so the rule cannot silently pass)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from deltaserve.engine.llm_engine import LLMEngine\n")
    assert _part(_imports(bad)[0]) == "engine"
    assert "engine" not in ALLOWED["ops"]
