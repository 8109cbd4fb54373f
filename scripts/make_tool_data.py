"""Synthetic tool-use and question/answer conversations for the embedded default model (offline, deterministic).

Five fixed tools (calculator, weather, unit conversion, file search, time zones) with deterministic fake
implementations, user phrasings and argument values split into a training and a held-out set, and plain
question/answer turns. `make_conversations(split, n, seed)` returns `Conversation`s; `render_example` turns one
into token ids plus a loss mask with the project's own chat renderer, so training and serving formats match exactly.

    python scripts/make_tool_data.py --split heldout -n 5     # print a few rendered examples
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import zlib
from dataclasses import dataclass
from typing import Any

from deltaserve.chat.messages import ChatMessage, ToolSpec
from deltaserve.parsers.types import ToolCall

SPLITS = ("train", "heldout")

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="calculator",
        description="Evaluate an arithmetic expression.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    ),
    ToolSpec(
        name="get_weather",
        description="Current weather in a city.",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    ),
    ToolSpec(
        name="convert_units",
        description="Convert a value between units.",
        parameters={
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "from_unit": {"type": "string"},
                "to_unit": {"type": "string"},
            },
            "required": ["value", "from_unit", "to_unit"],
        },
    ),
    ToolSpec(
        name="search_files",
        description="Find files matching a glob pattern.",
        parameters={
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "directory": {"type": "string"}},
            "required": ["pattern"],
        },
    ),
    ToolSpec(
        name="get_time",
        description="Current local time in a time zone.",
        parameters={"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    ),
)
TOOL_NAMES = tuple(t.name for t in TOOLS)

# ---- value pools: (train, heldout) ----
CITIES = (
    "Paris London Berlin Madrid Rome Lisbon Vienna Prague Warsaw Dublin Oslo Stockholm Helsinki Athens Cairo Lagos "
    "Nairobi Tokyo Osaka Seoul Beijing Shanghai Mumbai Delhi Bangkok Jakarta Manila Sydney Melbourne Auckland Toronto "
    "Montreal Chicago Boston Denver Seattle Houston Miami Lima Bogota Santiago Quito Havana Zurich Geneva Brussels "
    "Amsterdam Copenhagen Budapest Bucharest Sofia Kyiv Istanbul Dubai Doha Riyadh Tehran Karachi Dhaka Hanoi"
).split() + ["New York", "Los Angeles", "San Francisco", "Buenos Aires", "Mexico City", "Cape Town", "Hong Kong"]
HELDOUT_CITIES = (
    "Edinburgh Marseille Hamburg Valencia Naples Porto Krakow Bergen Tallinn Riga Vilnius Casablanca Accra Kyoto "
    "Busan Chennai Perth Wellington Vancouver Portland Austin Phoenix Montevideo Reykjavik Lyon Munich Seville"
).split() + ["Rio de Janeiro", "Kuala Lumpur", "Tel Aviv"]
TIMEZONES = (
    "Europe/Paris Europe/London Europe/Berlin Europe/Madrid Europe/Rome Europe/Moscow Europe/Athens Asia/Tokyo "
    "Asia/Seoul Asia/Shanghai Asia/Kolkata Asia/Dubai Asia/Singapore Asia/Bangkok Australia/Sydney Africa/Cairo "
    "Africa/Lagos America/New_York America/Chicago America/Denver America/Los_Angeles America/Toronto "
    "America/Sao_Paulo America/Mexico_City Pacific/Auckland UTC"
).split()
HELDOUT_TIMEZONES = (
    "Europe/Lisbon Europe/Oslo Asia/Jakarta Asia/Manila Australia/Perth Africa/Nairobi America/Lima "
    "America/Anchorage Pacific/Honolulu Asia/Karachi"
).split()
PATTERNS = "*.py *.md test_*.py *.json config* *.txt *.yaml *.csv README* *.rs *.go *.toml *.js *.c *.log".split()
HELDOUT_PATTERNS = "*.sh *.html notes_* *.ipynb *.sql *.xml".split()
DIRECTORIES = "src docs tests scripts data build lib app /tmp /etc ~/projects ~/notes".split()
HELDOUT_DIRECTORIES = "examples assets ~/Documents /var/log".split()
FILE_STEMS = "main utils config model server client parser index report notes setup app data core helpers".split()
# unit -> (dimension, factor to the base unit); temperatures are handled apart.
UNITS: dict[str, tuple[str, float]] = {
    "km": ("length", 1000.0), "miles": ("length", 1609.344), "meters": ("length", 1.0), "feet": ("length", 0.3048),
    "cm": ("length", 0.01), "inches": ("length", 0.0254), "kg": ("mass", 1.0), "pounds": ("mass", 0.45359237),
    "grams": ("mass", 0.001), "liters": ("volume", 1.0), "gallons": ("volume", 3.785411784),
    "celsius": ("temperature", 1.0), "fahrenheit": ("temperature", 1.0),
}  # fmt: skip
UNIT_PAIRS = [
    (a, b) for a in UNITS for b in UNITS
    if a != b and UNITS[a][0] == UNITS[b][0] and 1e-3 <= UNITS[a][1] / UNITS[b][1] <= 1e3
]  # fmt: skip
HELDOUT_UNIT_PAIRS = [("miles", "meters"), ("grams", "pounds"), ("gallons", "liters"), ("feet", "cm")]
TRAIN_UNIT_PAIRS = [p for p in UNIT_PAIRS if p not in HELDOUT_UNIT_PAIRS]
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")

# ---- phrasings: (train, heldout) per task kind ----
PHRASES: dict[str, tuple[list[str], list[str]]] = {
    "calculator": (
        ["What is {expr}?", "Calculate {expr}.", "Can you compute {expr} for me?", "How much is {expr}?",
         "Please evaluate {expr}.", "I need the result of {expr}.", "Work out {expr}.", "Quick math: {expr}",
         "what's {expr}", "Solve {expr} please.", "Use the calculator for {expr}.", "{expr} = ?"],
        ["Could you tell me what {expr} equals?", "Find the value of {expr}.", "Help me with this sum: {expr}",
         "Give me the answer to {expr}."],
    ),
    "get_weather": (
        ["What's the weather in {city}?", "How is the weather in {city} today?", "Is it raining in {city}?",
         "Tell me the weather for {city}.", "weather {city}", "What is the temperature in {city} right now?",
         "Will I need an umbrella in {city}?", "Weather report for {city}, please.", "Is it cold in {city}?"],
        ["I'm flying to {city} tomorrow, what's the weather like there?", "Give me the current conditions in {city}.",
         "How warm is it in {city}?", "Any idea what the weather is doing in {city}?"],
    ),
    "get_weather_f": (
        ["What's the weather in {city} in fahrenheit?", "Temperature in {city} in fahrenheit?",
         "Tell me the weather for {city} (fahrenheit)."],
        ["Check the weather in {city} in fahrenheit, please."],
    ),
    "convert_units": (
        ["Convert {value} {from_unit} to {to_unit}.", "How many {to_unit} is {value} {from_unit}?",
         "What is {value} {from_unit} in {to_unit}?", "{value} {from_unit} to {to_unit}",
         "Please convert {value} {from_unit} into {to_unit}.", "Turn {value} {from_unit} into {to_unit}."],
        ["I have {value} {from_unit}; how much is that in {to_unit}?", "Express {value} {from_unit} in {to_unit}.",
         "Change {value} {from_unit} to {to_unit} for me."],
    ),
    "search_files": (
        ["Find all {pattern} files in {directory}.", "Search for files matching {pattern} in {directory}.",
         "List the {pattern} files under {directory}.", "Look for {pattern} in {directory}.",
         "Which files in {directory} match {pattern}?", "Find files named {pattern} in {directory}."],
        ["Are there any files like {pattern} in {directory}?", "Locate files named {pattern} inside {directory}."],
    ),
    "search_files_nodir": (
        ["Which files match {pattern}?", "Find {pattern} files.", "Search for {pattern}."],
        ["Show me every file matching {pattern}."],
    ),
    "get_time": (
        ["What time is it in {timezone}?", "Current time in {timezone}?", "Tell me the time in {timezone}.",
         "What's the local time in {timezone}?", "time in {timezone}", "What is the time now in {timezone}?",
         "Clock check: {timezone}"],
        ["I need to call someone in {timezone}; what time is it there?", "Do you know the current hour in {timezone}?",
         "Check the clock in {timezone} for me."],
    ),
}  # fmt: skip

# Tool-neutral phrasings (train split only, `neutral` share): the same words for every tool, so that the tool can
# only be told from the value (an expression, a city, a "Region/City" zone, a glob...), which is what carries over to
# held-out phrasings whose words the tool's own train phrasings never use ("hour", "warm", "locate").
NEUTRAL_PHRASES = ["Can you check {x} for me?", "Look up {x}.", "I need some help with {x}.", "{x}, please.",
                   "Quick one: {x}?", "Do you have anything on {x}?", "Any info about {x}?", "Tell me about {x}."]
_NEUTRAL_VALUE = {
    "calculator": "{expr}", "get_weather": "{city}", "get_weather_f": "{city} in fahrenheit",
    "convert_units": "{value} {from_unit} in {to_unit}", "search_files": "{pattern} in {directory}",
    "search_files_nodir": "{pattern}", "get_time": "{timezone}",
}  # fmt: skip

# Plain question/answer turns, answered without a tool: (question, answer).
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Egypt": "Cairo",
    "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo", "Greece": "Athens", "India": "New Delhi",
    "China": "Beijing", "Brazil": "Brasilia", "Australia": "Canberra", "Mexico": "Mexico City", "Poland": "Warsaw",
    "Portugal": "Lisbon", "Sweden": "Stockholm", "Chile": "Santiago", "Ireland": "Dublin", "Austria": "Vienna",
}  # fmt: skip
HELDOUT_CAPITALS = {"Finland": "Helsinki", "Thailand": "Bangkok", "Cuba": "Havana", "Hungary": "Budapest"}
SMALL_TALK = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there", "Hi! What can I do for you?"),
    ("Who are you?", "I am Kimi, an AI assistant created by Moonshot AI."),
    ("What can you do?", "I can answer questions and use tools: a calculator, weather, unit conversion, file search "
     "and time zones."),
    ("Thanks!", "You're welcome!"),
    ("Thank you for the help.", "Glad I could help!"),
    ("Tell me a joke.", "Why do programmers prefer dark mode? Because light attracts bugs."),
    ("What is Python?", "Python is a popular programming language known for its readable syntax."),
    ("Good morning", "Good morning! How can I help?"),
    ("What does a linear attention layer keep?", "A fixed-size state per sequence instead of a growing cache."),
]
HELDOUT_SMALL_TALK = [("Hey, how are you?", "I'm doing well, thanks! How can I help you?")]
CAPITAL_PHRASES = (
    ["What is the capital of {country}?", "Capital of {country}?", "Which city is the capital of {country}?"],
    ["Name the capital city of {country}."],
)


# ---- deterministic tool implementations (shared by the data and the evaluation) ----
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_node(node.operand)
    raise ValueError("unsupported expression")


def fmt_number(x: float) -> str:
    """Integers without a decimal point; other values to 2 decimals, or 3 significant digits below 1."""
    if abs(x) < 1 and x != 0:
        return f"{x:.3g}"
    r = round(x, 2)
    return str(int(r)) if r == int(r) else f"{r:.2f}".rstrip("0")


def _hash(text: str) -> int:
    return zlib.crc32(text.lower().encode())


def run_tool(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Execute a tool on its arguments; raises KeyError / ValueError / TypeError on bad arguments."""
    if name == "calculator":
        return {"result": fmt_number(_eval_node(ast.parse(str(args["expression"]), mode="eval")))}
    if name == "get_weather":
        city, unit = str(args["city"]), args.get("unit", "celsius")
        if unit not in ("celsius", "fahrenheit"):
            raise ValueError(unit)
        h = _hash(city)
        temp_c = h % 36 - 5
        temp = temp_c if unit == "celsius" else round(temp_c * 9 / 5 + 32)
        return {"city": city, "temperature": temp, "unit": unit, "condition": CONDITIONS[(h >> 8) % len(CONDITIONS)]}
    if name == "convert_units":
        value, src, dst = float(args["value"]), str(args["from_unit"]), str(args["to_unit"])
        if UNITS[src][0] != UNITS[dst][0]:
            raise ValueError(f"{src} -> {dst}")
        if UNITS[src][0] == "temperature":
            out = value if src == dst else (value * 9 / 5 + 32 if src == "celsius" else (value - 32) * 5 / 9)
        else:
            out = value * UNITS[src][1] / UNITS[dst][1]
        return {"value": fmt_number(out), "unit": dst}
    if name == "search_files":
        pattern, directory = str(args["pattern"]), str(args.get("directory", "."))
        h = _hash(pattern + "|" + directory)
        files = []
        for k in range(1 + h % 3):
            stem = FILE_STEMS[(h >> (4 * k + 4)) % len(FILE_STEMS)]
            name_ = pattern.replace("*", stem, 1).replace("*", "")
            path = name_ if directory == "." else f"{directory.rstrip('/')}/{name_}"
            if path not in files:
                files.append(path)
        return {"files": files}
    if name == "get_time":
        tz = str(args["timezone"])
        h = _hash(tz + "@time")
        return {"timezone": tz, "time": f"{h % 24:02d}:{(h >> 5) % 60:02d}"}
    raise KeyError(name)


def answer_text(name: str, args: dict[str, Any], result: dict[str, Any]) -> str:
    """The final answer that uses the tool result."""
    if name == "calculator":
        return f"{args['expression']} = {result['result']}."
    if name == "get_weather":
        sign = "°C" if result["unit"] == "celsius" else "°F"
        return f"It is {result['temperature']}{sign} and {result['condition']} in {result['city']}."
    if name == "convert_units":
        return f"{fmt_number(float(args['value']))} {args['from_unit']} is {result['value']} {result['unit']}."
    if name == "search_files":
        files = result["files"]
        return f"I found {len(files)} file{'s' if len(files) != 1 else ''}: {', '.join(files)}."
    if name == "get_time":
        return f"It is {result['time']} in {result['timezone']}."
    raise KeyError(name)


def expected_in_answer(name: str, result: dict[str, Any]) -> list[str]:
    """Strings a final answer must contain to count as using the tool result."""
    if name == "calculator":
        return [str(result["result"])]
    if name == "get_weather":
        return [str(result["temperature"]), str(result["condition"])]
    if name == "convert_units":
        return [str(result["value"])]
    if name == "search_files":
        return list(result["files"])
    return [str(result["time"])]


@dataclass(frozen=True, slots=True)
class Conversation:
    """One synthetic exchange: the user question, the expected call (None: answer directly) and the final answer."""

    user: str
    tool: str | None
    arguments: dict[str, Any] | None
    result: dict[str, Any] | None
    answer: str
    thinking: bool
    offer_tools: bool = True

    def call_reasoning(self) -> str:
        return f"The user needs {self.tool.replace('_', ' ')}. I will call {self.tool}."

    def answer_reasoning(self) -> str:
        if self.tool is None:
            return "I can answer this directly."
        return "The tool returned the result, so I can answer."


def _expression(rng: random.Random) -> str:
    ops = ["+", "-", "*", "/"]
    a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 50)
    form = rng.random()
    if form < 0.55:
        return f"{a} {rng.choice(ops)} {b}"
    if form < 0.8:
        return f"{a} {rng.choice(ops[:3])} {b} {rng.choice(ops[:3])} {c}"
    return f"({a} {rng.choice(ops[:2])} {b}) {rng.choice(ops[2:])} {c}"


_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cr dr gr kr pl pr sh st tr".split()
_VOWELS = "a e i o u a e o ia ou".split()
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "t", "k"]
_REGIONS = "Europe Asia Africa America Australia Pacific Atlantic Indian".split()
_EXTS = "py md txt json yaml csv log rs go c h js ts toml cfg ini dat bin out tmp bak conf lock".split()


def _pseudo_word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    """A pronounceable made-up word; values like this cannot be memorised, only copied from the question."""
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(rng.randint(*syllables)))


def _synthetic_value(kind: str, rng: random.Random) -> str:
    """A random argument value of `kind` (city, timezone, pattern, directory) for copy training."""
    if kind == "city":
        words = [_pseudo_word(rng).capitalize() for _ in range(1 if rng.random() < 0.8 else 2)]
        return " ".join(words)
    if kind == "timezone":
        return f"{rng.choice(_REGIONS)}/{'_'.join(_pseudo_word(rng).capitalize() for _ in range(rng.randint(1, 2)))}"
    if kind == "pattern":
        form = rng.random()
        ext = rng.choice(_EXTS) if rng.random() < 0.5 else _pseudo_word(rng, (1, 1))
        if form < 0.6:
            return f"*.{ext}"
        if form < 0.8:
            return f"{_pseudo_word(rng, (1, 2))}_*"
        return f"{_pseudo_word(rng, (1, 2))}*.{ext}"
    parts = [_pseudo_word(rng, (1, 2)) for _ in range(rng.randint(1, 2))]
    root = rng.choice(["", "", "~/", "/", "./"])
    return root + "/".join(parts)


_PREFIXES = ["Hey, ", "Hi! ", "Quick question: ", "Hello. ", "Please help: ", "OK, ", "So, ", "One thing: "]
_SUFFIXES = [" Thanks.", " Thank you!", " Please.", " Thanks a lot.", " Cheers."]


def _number(rng: random.Random) -> float | int:
    return rng.randint(1, 500) if rng.random() < 0.7 else round(rng.uniform(0.5, 300), 1)


def _tool_task(kind: str, split: str, rng: random.Random,
               synthetic: float = 0.0) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(tool name, arguments, template fields) for one task of `kind`; `synthetic`: share of made-up values."""
    held = split == "heldout"

    def pick(pool: list[str], heldout_pool: list[str], value_kind: str) -> str:
        # `synthetic` is 0 for the held-out split and for stage 1, which then draws exactly as before.
        if synthetic and rng.random() < synthetic:
            return _synthetic_value(value_kind, rng)
        return rng.choice(heldout_pool if held else pool)

    if kind == "calculator":
        expr = _expression(rng)
        return "calculator", {"expression": expr}, {"expr": expr}
    if kind in ("get_weather", "get_weather_f"):
        city = pick(CITIES, HELDOUT_CITIES, "city")
        args: dict[str, Any] = {"city": city}
        if kind == "get_weather_f":
            args["unit"] = "fahrenheit"
        return "get_weather", args, {"city": city}
    if kind == "convert_units":
        src, dst = rng.choice(HELDOUT_UNIT_PAIRS if held else TRAIN_UNIT_PAIRS)
        value = _number(rng)
        return "convert_units", {"value": value, "from_unit": src, "to_unit": dst}, {
            "value": str(value), "from_unit": src, "to_unit": dst}
    if kind in ("search_files", "search_files_nodir"):
        pattern = pick(PATTERNS, HELDOUT_PATTERNS, "pattern")
        if kind == "search_files_nodir":
            return "search_files", {"pattern": pattern}, {"pattern": pattern}
        directory = pick(DIRECTORIES, HELDOUT_DIRECTORIES, "directory")
        return "search_files", {"pattern": pattern, "directory": directory}, {
            "pattern": pattern, "directory": directory}
    tz = pick(TIMEZONES, HELDOUT_TIMEZONES, "timezone")
    return "get_time", {"timezone": tz}, {"timezone": tz}


_KIND_WEIGHTS = {
    "calculator": 4, "get_weather": 3, "get_weather_f": 1, "convert_units": 4, "search_files": 3,
    "search_files_nodir": 1, "get_time": 3,
}  # fmt: skip


def make_tool_conversation(split: str, rng: random.Random, thinking: bool, synthetic: float = 0.0,
                           neutral: float = 0.0) -> Conversation:
    """One tool task of a random kind, phrased with a template of `split`.

    `synthetic` (train split only) is the share of made-up argument values (and of user turns with a random
    greeting or thanks around the template): with values that cannot be memorised the model has to learn to copy
    them from the question, which is what held-out values need. `neutral` (train only): the share phrased with a
    tool-neutral template (`NEUTRAL_PHRASES`).
    """
    if (synthetic or neutral) and split != "train":
        raise ValueError("synthetic values and neutral phrasings are for the train split only")
    kind = rng.choices(list(_KIND_WEIGHTS), weights=list(_KIND_WEIGHTS.values()))[0]
    name, args, fields = _tool_task(kind, split, rng, synthetic)
    # neutral 0 draws nothing here, so earlier stages' data stay as they were.
    if neutral and rng.random() < neutral:
        template = rng.choice(NEUTRAL_PHRASES).format(x=_NEUTRAL_VALUE[kind])
    else:
        template = rng.choice(PHRASES[kind][1 if split == "heldout" else 0])
    user = template.format(**fields)
    if rng.random() < 0.15 and split == "train" and not template.startswith("{"):  # a value keeps its case
        user = user[0].lower() + user[1:]
    if synthetic and rng.random() < synthetic / 2:
        user = rng.choice(_PREFIXES) + user if rng.random() < 0.5 else user + rng.choice(_SUFFIXES)
    result = run_tool(name, args)
    return Conversation(user, name, args, result, answer_text(name, args, result), thinking)


_COPY_PHRASES = ["Repeat after me: {x}", "Say {x}", "Echo this back: {x}", "Please repeat: {x}", "Copy: {x}",
                 "Write exactly this: {x}"]


def _copy_phrase(rng: random.Random) -> str:
    """1-4 made-up words, numbers, paths or clock times: the copy task's payload."""
    words = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.4:
            words.append(_pseudo_word(rng).capitalize() if rng.random() < 0.5 else _pseudo_word(rng))
        elif kind < 0.6:
            words.append(fmt_number(_number(rng)))
        elif kind < 0.8:
            words.append(_synthetic_value(rng.choice(["timezone", "pattern", "directory"]), rng))
        else:
            words.append(f"{rng.randrange(24):02d}:{rng.randrange(60):02d}")
    return " ".join(words)


_LOOKUP_KEYS = "temperature condition time value result city unit timezone name count size id code".split()


def _lookup_task(rng: random.Random) -> tuple[str, str]:
    """("Data: {json}. What is the {key}?", value): finding a key's value in a JSON object, as a final answer
    must find it in a tool result."""
    keys = rng.sample(_LOOKUP_KEYS, rng.randint(2, 4))
    data = {k: (_copy_phrase(rng).split()[0] if rng.random() < 0.6 else _number(rng)) for k in keys}
    key = rng.choice(keys)
    value = data[key] if isinstance(data[key], str) else fmt_number(data[key])
    return f"Data: {json.dumps(data)}. What is the {key}?", value


def _list_task(rng: random.Random) -> tuple[str, str]:
    """("Data: {"files": [...]}. List the files.", the file-search answer listing them all): copying a whole list,
    as a file-search answer must."""
    args = {"pattern": _synthetic_value("pattern", rng)}
    if rng.random() < 0.7:
        args["directory"] = _synthetic_value("directory", rng)
    result = run_tool("search_files", args)
    return f"Data: {json.dumps(result)}. List the files.", answer_text("search_files", args, result)


def make_plain_conversation(split: str, rng: random.Random, thinking: bool, copy_share: float = 0.0,
                            short_copy: bool = False, list_share: float = 0.0) -> Conversation:
    """A turn answered without a tool; with `copy_share` (train only), that share are copy tasks ("Repeat after me:
    X" -> "X"), the densest training signal for copying text out of the context. `short_copy`: copy tasks offer
    no tools (so they are a few dozen tokens, many to a row) and half of them are lookups in a JSON object."""
    held = split == "heldout"
    if copy_share and rng.random() < copy_share:
        x = _copy_phrase(rng)
        user = rng.choice(_COPY_PHRASES).format(x=x)
        offer = rng.random() < 0.8
        if short_copy and rng.random() < 0.5:
            # list_share 0 draws nothing here, so earlier stages' data stay as they were.
            user, x = _list_task(rng) if list_share and rng.random() < list_share else _lookup_task(rng)
        return Conversation(user, None, None, None, x, thinking, offer_tools=offer and not short_copy)
    if rng.random() < 0.5:
        caps = HELDOUT_CAPITALS if held else CAPITALS
        country = rng.choice(sorted(caps))
        q = rng.choice(CAPITAL_PHRASES[1 if held else 0]).format(country=country)
        a = f"The capital of {country} is {caps[country]}."
    else:
        q, a = rng.choice(HELDOUT_SMALL_TALK if held else SMALL_TALK)
    return Conversation(q, None, None, None, a, thinking, offer_tools=rng.random() < 0.8)


def make_conversations(split: str, n: int, seed: int, *, plain_share: float = 0.15,
                       thinking_share: float = 0.3, synthetic: float = 0.0,
                       short_copy: bool = False, copy_share: float | None = None,
                       list_share: float = 0.0, neutral_share: float = 0.0) -> list[Conversation]:
    """`n` conversations of `split` ("train" or "heldout"), deterministic in `seed` (see make_tool_conversation).
    `copy_share`: the share of plain turns that are copy / lookup tasks (default: `synthetic`); `list_share`: the
    share of lookups (with `short_copy`) that copy a whole file list instead; `neutral_share`: the share of tool
    tasks phrased with a tool-neutral template."""
    copy = synthetic if copy_share is None else copy_share
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    rng = random.Random(f"{split}-{seed}")
    out = []
    for _ in range(n):
        thinking = rng.random() < thinking_share
        if rng.random() < plain_share:
            out.append(make_plain_conversation(split, rng, thinking, copy, short_copy, list_share))
        else:
            out.append(make_tool_conversation(split, rng, thinking, synthetic, neutral_share))
    return out


def call_id(name: str) -> str:
    return f"functions.{name}:0"


def messages_of(conv: Conversation) -> list[ChatMessage]:
    """The whole exchange as chat messages (user, [assistant call, tool result], assistant answer)."""
    msgs = [ChatMessage(role="user", content=conv.user)]
    if conv.tool is not None:
        call = ToolCall(id=call_id(conv.tool), name=conv.tool, arguments=json.dumps(conv.arguments))
        msgs.append(ChatMessage(role="assistant", content="", reasoning=conv.call_reasoning(), tool_calls=(call,)))
        msgs.append(ChatMessage(role="tool", content=json.dumps(conv.result), tool_call_id=call_id(conv.tool)))
    msgs.append(ChatMessage(role="assistant", content=conv.answer, reasoning=conv.answer_reasoning()))
    return msgs


def render_example(fmt: Any, conv: Conversation) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation: 1 on every assistant-generated token (incl. `<|im_end|>`).

    Each assistant turn is appended to the prompt the server would render for it, so the prompt part is
    byte-identical to serving; the turn itself is what the model must generate after the generation prompt.
    """
    tools = TOOLS if conv.offer_tools else ()
    msgs = messages_of(conv)
    tok = fmt.tokenizer
    ids: list[int] = []
    mask: list[int] = []
    for t, msg in enumerate(msgs):
        if msg.role != "assistant":
            continue
        prompt = fmt.render(msgs[:t], tools=tools, thinking=conv.thinking, add_generation_prompt=True)
        if prompt[: len(ids)] != ids:
            raise RuntimeError("rendered history is not a prefix of the next prompt")
        mask += [0] * (len(prompt) - len(ids))
        ids = list(prompt)
        target = _turn_ids(fmt, tok, msg, conv.thinking)
        ids += target
        mask += [1] * len(target)
    return ids, mask


def _turn_ids(fmt: Any, tok: Any, msg: ChatMessage, thinking: bool) -> list[int]:
    """The tokens of one assistant turn after the generation prompt, as the renderer would write them."""
    sp = tok.special_tokens
    out: list[int] = []
    if thinking:
        out += tok.encode(msg.reasoning or "", allow_special=False) + [sp["</think>"]]
    text = msg.content
    if text:
        out += tok.encode(text, allow_special=False)
    for k, call in enumerate(msg.tool_calls):
        if k == 0:
            out.append(sp["<|tool_calls_section_begin|>"])
        out.append(sp["<|tool_call_begin|>"])
        out += tok.encode(call.id, allow_special=False) + [sp["<|tool_call_argument_begin|>"]]
        out += tok.encode(call.arguments, allow_special=False) + [sp["<|tool_call_end|>"]]
    if msg.tool_calls:
        out.append(sp["<|tool_calls_section_end|>"])
    out.append(sp["<|im_end|>"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=SPLITS, default="train")
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="checkpoint directory whose tokenizer renders (default: embedded)")
    args = ap.parse_args()
    from deltaserve.chat import get_chat_format
    from deltaserve.default_model import default_model_dir
    from deltaserve.text.tokenizer import Tokenizer

    model = args.model or str(default_model_dir())
    tok = Tokenizer.from_pretrained(model)
    fmt = get_chat_format(model, tok)
    for conv in make_conversations(args.split, args.n, args.seed):
        ids, mask = render_example(fmt, conv)
        print(tok.decode(ids), f"\n[{len(ids)} tokens, {sum(mask)} trained]\n")


if __name__ == "__main__":
    main()
