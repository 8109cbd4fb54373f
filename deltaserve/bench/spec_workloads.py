"""Workloads of `deltaserve bench spec`: token-id prompts built offline and deterministically (no download).

- `code-edit`: "rewrite this function with a variable renamed" as a plain-text completion (no chat template): a
  function or method of the installed CPython standard library, a comment asking for the rename, and the first line
  of the rewritten function. The expected output copies the rest of the prompt's function, the case prompt lookup
  (n-gram) is made for. The embedded model was trained on standard-library code (raw rows, not chats).
- `tool-chat`: chats in the embedded model's own domain, rendered with the checkpoint's chat format and its five
  tools (the shapes of `scripts/make_tool_data.py`, which the package cannot import): half end after the user's
  question (the model writes the tool call, with thinking on for half of those), half after the tool's result (the
  model writes the answer that uses it). Phrasings and values are held-out style (not the training templates).
- `random`: uniformly random ordinary token ids (no structure for a proposer to find).

Outputs stop at the model's end-of-sequence token except for `random` (eos ignored, exact lengths), so greedy runs
with and without speculation generate the same tokens.
"""

from __future__ import annotations

import ast
import io
import json
import random
import sysconfig
import textwrap
import tokenize
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.text.tokenizer import Tokenizer

WORKLOADS = ("code-edit", "tool-chat", "random")
RANDOM_PROMPT_LEN = 128
"""Prompt tokens of the `random` workload."""
_CODE_LINES = (6, 30)
"""Functions of this many source lines (inclusive) are eligible for `code-edit`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """Prompts of one workload and how their outputs end."""

    name: str
    prompts: list[list[int]]
    ignore_eos: bool
    """True: every request generates exactly `max_tokens` (random); False: it stops at eos (or at `max_tokens`)."""
    sources: list[str]
    """Where each prompt comes from (a stdlib function, a tool task), for the result JSON."""


def build_workload(name: str, tokenizer: Tokenizer, model_dir: str, num: int, seed: int) -> Workload:
    """`num` prompts of workload `name` (one of WORKLOADS), deterministic in `seed` (and, for code-edit, in the
    installed standard library)."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    if name == "code-edit":
        prompts, sources = code_edit_prompts(tokenizer, num, seed)
        return Workload(name=name, prompts=prompts, ignore_eos=False, sources=sources)
    if name == "tool-chat":
        prompts, sources = tool_chat_prompts(tokenizer, model_dir, num, seed)
        return Workload(name=name, prompts=prompts, ignore_eos=False, sources=sources)
    if name == "random":
        rng = random.Random(f"random-{seed}")
        bound = _ordinary_id_bound(tokenizer)
        prompts = [[rng.randrange(bound) for _ in range(RANDOM_PROMPT_LEN)] for _ in range(num)]
        return Workload(name=name, prompts=prompts, ignore_eos=True, sources=[f"random {RANDOM_PROMPT_LEN}"] * num)
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def _ordinary_id_bound(tokenizer: Tokenizer) -> int:
    special = set(tokenizer.special_tokens.values()) | set(tokenizer.all_special_ids)
    return min(special | {tokenizer.vocab_size})


# ---- code-edit ----


@dataclass(frozen=True, slots=True)
class CodeEdit:
    """One rename task: the function's source, the renamed name and the rewritten source."""

    source: str
    """`file:qualified name` in the standard library."""
    code: str
    old: str
    new: str
    rewritten: str

    @property
    def prompt_text(self) -> str:
        first = self.rewritten.splitlines(keepends=True)[0]
        return f"{self.code}\n\n# The same function with `{self.old}` renamed to `{self.new}`:\n{first}"


def code_edits(num: int, seed: int, stdlib: str | None = None) -> list[CodeEdit]:
    """`num` rename tasks, at most one per module, from the top-level modules of the standard library in an order
    shuffled by `seed`."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(p.name for p in root.glob("*.py"))
    random.Random(f"code-edit-{seed}").shuffle(files)
    out: list[CodeEdit] = []
    for name in files:
        edit = _first_edit(root / name, seed)
        if edit is not None:
            out.append(edit)
            if len(out) == num:
                return out
    if not out:
        raise ValueError(f"no function in {root} suits the code-edit workload")
    return [out[i % len(out)] for i in range(num)]  # a small library: prompts repeat


def _first_edit(path: Path, seed: int) -> CodeEdit | None:
    """The eligible function of `path` that `seed` picks, renamed; None when the file has none."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    lines = text.splitlines(keepends=True)
    candidates = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if not _CODE_LINES[0] <= node.end_lineno - start + 1 <= _CODE_LINES[1]:
            continue
        code = textwrap.dedent("".join(lines[start - 1:node.end_lineno]))
        old = _rename_target(node, code)
        if old is not None:
            candidates.append((node.name, code, old))
    if not candidates:
        return None
    fn, code, old = candidates[zlib.crc32(f"{path.name}-{seed}".encode()) % len(candidates)]
    new = f"new_{old}"
    return CodeEdit(source=f"{path.name}:{fn}", code=code, old=old, new=new, rewritten=_rename(code, old, new))


def _rename_target(node: ast.FunctionDef, code: str) -> str | None:
    """The first parameter (not self / cls) used at least twice in the body, else None."""
    names = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
    try:
        counts: dict[str, int] = {}
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME:
                counts[tok.string] = counts.get(tok.string, 0) + 1
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    return next((n for n in names if n not in ("self", "cls") and counts.get(n, 0) >= 3), None)


def _rename(code: str, old: str, new: str) -> str:
    """`code` with every NAME token `old` replaced (strings and comments untouched), layout kept."""
    out: list[str] = []
    lines = code.splitlines(keepends=True)
    row, col = 1, 0
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type != tokenize.NAME or tok.string != old:
            continue
        (srow, scol), (erow, ecol) = tok.start, tok.end
        out.append(_slice(lines, (row, col), (srow, scol)))
        out.append(new)
        row, col = erow, ecol
    out.append(_slice(lines, (row, col), (len(lines) + 1, 0)))
    return "".join(out)


def _slice(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    (r0, c0), (r1, c1) = start, end
    if r0 == r1:
        return lines[r0 - 1][c0:c1]
    return lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + (lines[r1 - 1][:c1] if r1 <= len(lines) else "")


def code_edit_prompts(tokenizer: Tokenizer, num: int, seed: int) -> tuple[list[list[int]], list[str]]:
    edits = code_edits(num, seed)
    return ([tokenizer.encode(e.prompt_text, allow_special=False) for e in edits],
            [f"{e.source} ({e.old} -> {e.new})" for e in edits])


# ---- tool-chat ----

_TOOLS: tuple[dict[str, Any], ...] = (
    {"name": "calculator", "description": "Evaluate an arithmetic expression.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
    {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
         "type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}},
    {"name": "convert_units", "description": "Convert a value between units.",
     "parameters": {"type": "object", "properties": {"value": {"type": "number"}, "from_unit": {"type": "string"},
                                                     "to_unit": {"type": "string"}},
                    "required": ["value", "from_unit", "to_unit"]}},
    {"name": "search_files", "description": "Find files matching a glob pattern.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "directory": {"type": "string"}},
                    "required": ["pattern"]}},
    {"name": "get_time", "description": "Current local time in a time zone.",
     "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}},
)
"""The embedded model's five tools, as `scripts/make_tool_data.py` declares them (same names, order and schemas)."""
_CITIES = "Edinburgh Marseille Hamburg Valencia Naples Porto Krakow Bergen Tallinn Riga Kyoto Perth Lyon".split()
_ZONES = "Europe/Lisbon Europe/Oslo Asia/Jakarta Asia/Manila Australia/Perth Africa/Nairobi America/Lima".split()
_PATTERNS = "*.sh *.html notes_* *.ipynb *.sql *.xml".split()
_DIRS = "examples assets ~/Documents /var/log".split()
_UNITS = (("miles", "meters", 1609.344), ("grams", "pounds", 0.00220462), ("gallons", "liters", 3.785411784),
          ("feet", "cm", 30.48))
_STEMS = "main utils config model server client parser index report notes".split()
_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
_QUESTIONS = {
    "calculator": ["Could you tell me what {expression} equals?", "Find the value of {expression}."],
    "get_weather": ["Give me the current conditions in {city}.", "How warm is it in {city}?"],
    "convert_units": ["Express {value} {from_unit} in {to_unit}.", "Change {value} {from_unit} to {to_unit} for me."],
    "search_files": ["Locate files named {pattern} inside {directory}.",
                     "Are there any files like {pattern} in {directory}?"],
    "get_time": ["Do you know the current hour in {timezone}?", "Check the clock in {timezone} for me."],
}


@dataclass(frozen=True, slots=True)
class ToolTask:
    """One tool task: the question, the call the model should make and the tool's (made-up) result."""

    tool: str
    question: str
    arguments: dict[str, Any]
    result: dict[str, Any]


def tool_task(rng: random.Random) -> ToolTask:
    """A random task for one of the five tools, with a deterministic fake result."""
    tool = rng.choice(list(_QUESTIONS))
    args: dict[str, Any]
    if tool == "calculator":
        a, b, op = rng.randint(2, 999), rng.randint(2, 99), rng.choice("+-*")
        args = {"expression": f"{a} {op} {b}"}
        result: dict[str, Any] = {"result": str(a + b if op == "+" else a - b if op == "-" else a * b)}
    elif tool == "get_weather":
        args = {"city": rng.choice(_CITIES)}
        result = {"city": args["city"], "temperature": rng.randint(-5, 30), "unit": "celsius",
                  "condition": rng.choice(_CONDITIONS)}
    elif tool == "convert_units":
        src, dst, factor = rng.choice(_UNITS)
        value = rng.randint(1, 500)
        args = {"value": value, "from_unit": src, "to_unit": dst}
        result = {"value": f"{value * factor:.2f}".rstrip("0").rstrip("."), "unit": dst}
    elif tool == "search_files":
        args = {"pattern": rng.choice(_PATTERNS), "directory": rng.choice(_DIRS)}
        stems = rng.sample(_STEMS, rng.randint(1, 3))
        result = {"files": [f"{args['directory'].rstrip('/')}/{args['pattern'].replace('*', s, 1).replace('*', '')}"
                            for s in stems]}
    else:
        args = {"timezone": rng.choice(_ZONES)}
        result = {"timezone": args["timezone"], "time": f"{rng.randrange(24):02d}:{rng.randrange(60):02d}"}
    question = rng.choice(_QUESTIONS[tool]).format(**args)
    return ToolTask(tool=tool, question=question, arguments=args, result=result)


def tool_chat_prompts(tokenizer: Tokenizer, model_dir: str, num: int,
                      seed: int) -> tuple[list[list[int]], list[str]]:
    """`num` rendered chats: even ones end after the question (thinking on for every other one), odd ones after
    the tool result."""
    from deltaserve.chat import get_chat_format
    from deltaserve.chat.messages import ChatMessage, ToolSpec
    from deltaserve.parsers.types import ToolCall

    fmt = get_chat_format(model_dir, tokenizer)
    tools = [ToolSpec(**t) for t in _TOOLS]
    rng = random.Random(f"tool-chat-{seed}")
    prompts, sources = [], []
    for i in range(num):
        task = tool_task(rng)
        msgs = [ChatMessage(role="user", content=task.question)]
        thinking = i % 4 == 2
        if i % 2:
            call_id = f"functions.{task.tool}:0"
            call = ToolCall(id=call_id, name=task.tool, arguments=json.dumps(task.arguments))
            msgs += [ChatMessage(role="assistant", content="", tool_calls=(call,)),
                     ChatMessage(role="tool", content=json.dumps(task.result), tool_call_id=call_id)]
        prompts.append(fmt.render(msgs, tools=tools, thinking=thinking, add_generation_prompt=True))
        sources.append(f"{task.tool} {'answer' if i % 2 else 'call'}{' thinking' if thinking else ''}")
    return prompts, sources
