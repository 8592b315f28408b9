"""Synthetic chat corpus for the bundled demo model (issue 6), rendered with the real Qwen3.5 template.

Every conversation is a pure function of (split, index, base seed): the same call gives the same text
on any machine. Assistant replies are templated (few variants, skewed) so a tiny model can learn them
and its MTP head can predict them; user prompts, numbers, places and files vary so held-out prompts are
new strings. Never imports torch: the tests and the tokenizer trainer use it alone.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TEMPLATE_PATH = Path(__file__).resolve().parent / "chat_template.jinja"
BASE_SEED = 20261129

# spec/mtp-speculation.md §8.2: the tools the demo model knows. Kept short: the template repeats them
# in every tool conversation's system turn.
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_current_time",
        "description": "Current date and time in a time zone.",
        "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "description": "IANA time zone, e.g. Europe/Paris"}},
            "required": ["timezone"]}}},
    {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a text file from the sandbox folder.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "file name inside the sandbox"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "convert_units",
        "description": "Convert a value between units.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"},
            "from_unit": {"type": "string"},
            "to_unit": {"type": "string"}},
            "required": ["value", "from_unit", "to_unit"]}}},
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)

CITIES = {
    "Paris": "Europe/Paris", "Berlin": "Europe/Berlin", "London": "Europe/London",
    "Madrid": "Europe/Madrid", "Rome": "Europe/Rome", "Vienna": "Europe/Vienna",
    "Oslo": "Europe/Oslo", "Lisbon": "Europe/Lisbon", "Athens": "Europe/Athens",
    "Warsaw": "Europe/Warsaw", "Tokyo": "Asia/Tokyo", "Seoul": "Asia/Seoul",
    "Singapore": "Asia/Singapore", "Dubai": "Asia/Dubai", "Kolkata": "Asia/Kolkata",
    "Shanghai": "Asia/Shanghai", "Sydney": "Australia/Sydney", "Auckland": "Pacific/Auckland",
    "New York": "America/New_York", "Chicago": "America/Chicago", "Denver": "America/Denver",
    "Los Angeles": "America/Los_Angeles", "Toronto": "America/Toronto",
    "Mexico City": "America/Mexico_City", "Sao Paulo": "America/Sao_Paulo",
    "Cairo": "Africa/Cairo", "Nairobi": "Africa/Nairobi", "Lagos": "Africa/Lagos",
    "Reykjavik": "Atlantic/Reykjavik", "Honolulu": "Pacific/Honolulu",
}
UTC_OFFSETS = {
    "Europe/Paris": 1, "Europe/Berlin": 1, "Europe/London": 0, "Europe/Madrid": 1, "Europe/Rome": 1,
    "Europe/Vienna": 1, "Europe/Oslo": 1, "Europe/Lisbon": 0, "Europe/Athens": 2, "Europe/Warsaw": 1,
    "Asia/Tokyo": 9, "Asia/Seoul": 9, "Asia/Singapore": 8, "Asia/Dubai": 4, "Asia/Kolkata": 5,
    "Asia/Shanghai": 8, "Australia/Sydney": 10, "Pacific/Auckland": 12, "America/New_York": -5,
    "America/Chicago": -6, "America/Denver": -7, "America/Los_Angeles": -8, "America/Toronto": -5,
    "America/Mexico_City": -6, "America/Sao_Paulo": -3, "Africa/Cairo": 2, "Africa/Nairobi": 3,
    "Africa/Lagos": 1, "Atlantic/Reykjavik": 0, "Pacific/Honolulu": -10,
}

# (from, to, factor or None for temperature, long names)
UNITS = [
    ("km", "mi", 0.621371, "kilometers", "miles"),
    ("mi", "km", 1.609344, "miles", "kilometers"),
    ("kg", "lb", 2.204623, "kilograms", "pounds"),
    ("lb", "kg", 0.453592, "pounds", "kilograms"),
    ("m", "ft", 3.280840, "meters", "feet"),
    ("ft", "m", 0.304800, "feet", "meters"),
    ("cm", "in", 0.393701, "centimeters", "inches"),
    ("in", "cm", 2.540000, "inches", "centimeters"),
    ("L", "gal", 0.264172, "liters", "gallons"),
    ("gal", "L", 3.785412, "gallons", "liters"),
    ("C", "F", None, "degrees Celsius", "degrees Fahrenheit"),
    ("F", "C", None, "degrees Fahrenheit", "degrees Celsius"),
]

FILE_WORDS = ["milk", "eggs", "bread", "apples", "coffee", "rice", "butter", "cheese", "tea", "pasta",
              "tomatoes", "onions", "lemons", "honey", "beans", "carrots", "oranges", "flour"]
TODO_ITEMS = ["call the bank", "water the plants", "fix the bike", "book the dentist", "pay the rent",
              "clean the kitchen", "reply to Anna", "buy a gift", "renew the passport", "back up the laptop",
              "read chapter 3", "walk the dog", "update the budget", "send the report"]
NOTE_LINES = ["Meeting moved to Thursday.", "The server restarts at 2 am.", "Ask Tom about the keys.",
              "Train leaves at 8:15.", "Password hint is in the blue book.", "Lunch with Mia on Friday.",
              "The printer needs toner.", "Project demo next week.", "Budget review is done.",
              "Remember the umbrella.", "New office code is 4417.", "Garden party on Sunday."]
FILE_STEMS = ["notes", "todo", "shopping", "ideas", "plan", "journal", "tasks", "list", "memo", "draft",
              "groceries", "reminders", "log", "week", "summary"]
FILE_EXTS = [".txt", ".md"]

NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sam", "Tara", "Victor"]
FRUITS = ["apple", "banana", "cherry", "mango", "pear", "plum", "grape", "kiwi", "peach", "lemon", "orange",
          "melon", "apricot", "fig"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "gray"]
ANIMALS = ["cat", "dog", "horse", "rabbit", "tiger", "eagle", "dolphin", "fox", "owl", "bear", "wolf",
           "zebra", "panda", "otter"]
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Egypt", "Chile", "Spain",
             "Italy", "Peru", "Greece", "Vietnam"]
LIST_TOPICS = {"fruits": FRUITS, "colors": COLORS, "animals": ANIMALS, "countries": COUNTRIES}
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
NUM_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant.",
                  "You are a friendly assistant running on this computer."]


def _fmt_num(x: float) -> str:
    """Numbers as a person writes them: integers without a point, others to at most 3 decimals."""
    if abs(x - round(x)) < 1e-9:
        return str(int(round(x)))
    s = f"{x:.3f}".rstrip("0").rstrip(".")
    return "0" if s == "-0" else s


def _pick(rng: random.Random, options: list[str], weights: list[float] | None = None) -> str:
    return rng.choices(options, weights=weights or [1.0] * len(options))[0]


# --------------------------------------------------------------------------- one exchange per topic
# Each maker returns (user_text, assistant_turns, kind) where assistant_turns is a list of messages that
# follow the user turn (assistant with optional tool_calls, tool results, final assistant).

@dataclass
class Exchange:
    user: str
    replies: list[dict[str, Any]]
    kind: str            # topic name
    uses_tool: bool = False
    tool_call: dict[str, Any] | None = None   # the expected first call {name, arguments}


def _assistant(content: str, reasoning: str = "", tool_calls: list | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if tool_calls:
        m["tool_calls"] = [{"type": "function", "function": c} for c in tool_calls]
    return m


def small_talk(rng: random.Random, tools: bool) -> Exchange:
    name = rng.choice(NAMES)
    kind = rng.randrange(8)
    if kind == 0:
        greet = _pick(rng, ["Hello", "Hi", "Hey", "Good morning", "Good evening", "Hi there"])
        intro = rng.choice(["", f" I am {name}.", f" My name is {name}.", ""])
        user = f"{greet}!{intro}"
        who = f", {name}" if intro else ""
        reply = _pick(rng, [f"Hello{who}! How can I help you today?", f"Hi{who}! What can I do for you?"],
                      [0.75, 0.25])
    elif kind == 1:
        user = _pick(rng, ["How are you?", "How are you today?", "How is it going?", "How are things?"])
        reply = "I am doing well, thank you for asking! How can I help you?"
    elif kind == 2:
        user = _pick(rng, ["Thanks!", "Thank you.", "Thanks a lot!", "Great, thank you!", "Perfect, thanks."])
        reply = "You are welcome! Let me know if you need anything else."
    elif kind == 3:
        user = _pick(rng, ["What is your name?", "Who are you?", "What are you?", "Tell me about yourself."])
        reply = ("I am a small demo assistant for mtpchat. I can chat, do arithmetic, convert units, "
                 "work with dates, write short code and make lists and tables.")
    elif kind == 4:
        user = _pick(rng, ["Tell me a joke.", "Do you know a joke?", "Make me laugh.", "Say something funny."])
        reply = _pick(rng, [
            "Why did the computer go to the doctor? Because it had a virus!",
            "Why do programmers prefer dark mode? Because light attracts bugs!",
            "Why was the math book sad? It had too many problems.",
        ])
    elif kind == 5:
        user = _pick(rng, ["Goodbye!", "Bye!", "See you later.", "That is all for now, bye."])
        reply = "Goodbye! Have a great day."
    elif kind == 6:
        thing = rng.choice(FRUITS + ANIMALS + COLORS)
        user = _pick(rng, [f"Do you like {thing}s?", f"What do you think about {thing}s?",
                           f"Is {thing} a good word?"])
        reply = f"I do not have personal tastes, but many people like {thing}s. What about you?"
    else:
        user = _pick(rng, ["What can you do?", "How can you help me?", "What are you good at?"])
        if tools:
            reply = ("I can chat and answer questions. With the tools here I can check the time, "
                     "calculate, read files in the sandbox and convert units.")
        else:
            reply = ("I can chat, do arithmetic, convert units, work with dates, write short code "
                     "and make lists and tables.")
    return Exchange(user, [_assistant(reply)], "small_talk")


def _arith_problem(rng: random.Random) -> tuple[str, str, float]:
    op = rng.choice("+-*/")
    if op == "+":
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        val = a + b
    elif op == "-":
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        val = a - b
    elif op == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        val = a * b
    else:
        b = rng.randint(2, 30)
        a = b * rng.randint(2, 40)
        val = a // b
    return f"{a} {op} {b}", op, val


def arithmetic(rng: random.Random, tools: bool) -> Exchange:
    expr, op, val = _arith_problem(rng)
    a, _, b = expr.split(" ")
    word = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}[op]
    user = _pick(rng, [f"What is {expr}?", f"Calculate {expr}.", f"What is {a} {word} {b}?",
                       f"Compute {expr} please.", f"How much is {expr}?", f"{expr} = ?"])
    if tools:
        call = {"name": "calculator", "arguments": {"expression": expr}}
        result = json.dumps({"result": val})
        return Exchange(user, [
            _assistant("", f"The user wants {expr}. I will use the calculator.", [call]),
            {"role": "tool", "content": result},
            _assistant(f"{expr} = {_fmt_num(val)}."),
        ], "arithmetic", True, call)
    return Exchange(user, [_assistant(f"{expr} = {_fmt_num(val)}.", f"I need to compute {expr}. "
                                      f"The result is {_fmt_num(val)}.")], "arithmetic")


def _convert(value: float, u: tuple) -> float:
    src, factor = u[0], u[2]
    if factor is not None:
        return value * factor
    return value * 9 / 5 + 32 if src == "C" else (value - 32) * 5 / 9


def units(rng: random.Random, tools: bool) -> Exchange:
    u = rng.choice(UNITS)
    value = rng.randint(1, 500) if rng.random() < 0.7 else round(rng.uniform(0.5, 300), 1)
    if u[0] in "CF":
        value = rng.randint(-20, 110)
    v = _fmt_num(value)
    user = _pick(rng, [f"Convert {v} {u[0]} to {u[1]}.", f"How many {u[4]} is {v} {u[3]}?",
                       f"What is {v} {u[3]} in {u[4]}?", f"{v} {u[0]} in {u[1]}?",
                       f"Please convert {v} {u[3]} to {u[4]}."])
    res = _fmt_num(_convert(value, u))
    answer = f"{v} {u[0]} is about {res} {u[1]}."
    if tools:
        call = {"name": "convert_units", "arguments": {"value": value, "from_unit": u[0], "to_unit": u[1]}}
        result = json.dumps({"value": value, "from_unit": u[0], "to_unit": u[1], "result": float(res)})
        return Exchange(user, [
            _assistant("", f"The user wants {v} {u[0]} in {u[1]}. I will use convert_units.", [call]),
            {"role": "tool", "content": result},
            _assistant(answer),
        ], "units", True, call)
    factor = "the temperature formula" if u[2] is None else f"the factor {u[2]}"
    return Exchange(user, [_assistant(answer, f"I convert {u[0]} to {u[1]} with {factor}.")], "units")


def _date(rng: random.Random) -> dt.date:
    return dt.date(2020, 1, 1) + dt.timedelta(days=rng.randrange(3650))


def dates(rng: random.Random, tools: bool) -> Exchange:
    d = _date(rng)
    ds = d.isoformat()
    kind = rng.randrange(4)
    if kind == 0:
        user = _pick(rng, [f"What day of the week is {ds}?", f"Which weekday was {ds}?",
                           f"What weekday is {ds}?"])
        wd = WEEKDAYS[d.weekday()]
        return Exchange(user, [_assistant(f"{ds} is a {wd}.", f"I look up the weekday of {ds}.")], "dates")
    if kind == 1:
        n = rng.randint(1, 120)
        user = _pick(rng, [f"What date is {n} days after {ds}?", f"Add {n} days to {ds}.",
                           f"Which date comes {n} days after {ds}?"])
        r = (d + dt.timedelta(days=n)).isoformat()
        return Exchange(user, [_assistant(f"{n} days after {ds} is {r}.", f"I add {n} days to {ds}.")],
                        "dates")
    if kind == 2:
        e = d + dt.timedelta(days=rng.randint(1, 400))
        es = e.isoformat()
        user = _pick(rng, [f"How many days are between {ds} and {es}?",
                           f"Count the days from {ds} to {es}."])
        n = (e - d).days
        return Exchange(user, [_assistant(f"There are {n} days between {ds} and {es}.",
                                          f"I subtract {ds} from {es}.")], "dates")
    user = _pick(rng, [f"Write {ds} in words.", f"How do you say the date {ds} in words?"])
    words = f"{MONTHS[d.month - 1]} {d.day}, {d.year}"
    return Exchange(user, [_assistant(f"{ds} is {words}.")], "dates")


CODE_TASKS = [
    ("returns the square of a number", "square", "n", "return n * n"),
    ("returns the cube of a number", "cube", "n", "return n * n * n"),
    ("doubles a number", "double", "n", "return 2 * n"),
    ("reverses a string", "reverse", "s", "return s[::-1]"),
    ("checks if a number is even", "is_even", "n", "return n % 2 == 0"),
    ("returns the sum of a list", "total", "items", "return sum(items)"),
    ("returns the largest item of a list", "largest", "items", "return max(items)"),
    ("counts the words in a string", "count_words", "text", "return len(text.split())"),
    ("converts a string to upper case", "shout", "text", "return text.upper()"),
    ("returns the average of a list", "average", "items", "return sum(items) / len(items)"),
]


def code(rng: random.Random, tools: bool) -> Exchange:
    desc, fname, arg, body = rng.choice(CODE_TASKS)
    lang = "Python"
    user = _pick(rng, [f"Write a {lang} function that {desc}.", f"Can you write a function that {desc}?",
                       f"Show me {lang} code that {desc}.", f"I need a function that {desc}."])
    if rng.random() < 0.3:
        fname = rng.choice(["f", "g", "helper", "compute", "solve"]) + "_" + fname
        user = user[:-1] + f", named {fname}."
    reply = (f"Here is a {lang} function:\n\n```python\ndef {fname}({arg}):\n    {body}\n```\n\n"
             f"Call it like `{fname}(x)`.")
    return Exchange(user, [_assistant(reply)], "code")


def lists_tables(rng: random.Random, tools: bool) -> Exchange:
    kind = rng.randrange(3)
    if kind == 0:
        topic = rng.choice(list(LIST_TOPICS))
        n = rng.randint(2, 6)
        items = rng.sample(LIST_TOPICS[topic], n)
        user = _pick(rng, [f"List {NUM_WORDS[n]} {topic}.", f"Name {n} {topic}.",
                           f"Give me a list of {n} {topic}."])
        body = "\n".join(f"- {x.capitalize() if topic != 'countries' else x}" for x in items)
        return Exchange(user, [_assistant(f"Here are {n} {topic}:\n\n{body}")], "lists")
    if kind == 1:
        what = rng.choice(["squares", "cubes", "doubles"])
        lo = rng.randint(1, 12)
        hi = lo + rng.randint(2, 5)
        user = _pick(rng, [f"Make a table of the {what} of {lo} to {hi}.",
                           f"Show the {what} of the numbers {lo} to {hi} in a table."])
        f = {"squares": lambda x: x * x, "cubes": lambda x: x ** 3, "doubles": lambda x: 2 * x}[what]
        col = what[:-1].capitalize()
        rows = "\n".join(f"| {i} | {f(i)} |" for i in range(lo, hi + 1))
        return Exchange(user, [_assistant(f"| Number | {col} |\n|---|---|\n{rows}")], "tables")
    n = rng.randint(2, 4)
    people = rng.sample(NAMES, n)
    ages = [rng.randint(18, 80) for _ in people]
    facts = ", ".join(f"{p} is {a}" for p, a in zip(people, ages, strict=True))
    user = _pick(rng, [f"Put this in a table: {facts}.", f"Make a table of names and ages: {facts}."])
    rows = "\n".join(f"| {p} | {a} |" for p, a in zip(people, ages, strict=True))
    return Exchange(user, [_assistant(f"| Name | Age |\n|---|---|\n{rows}")], "tables")


def time_query(rng: random.Random, tools: bool) -> Exchange:
    city = rng.choice(list(CITIES))
    tz = CITIES[city]
    user = _pick(rng, [f"What time is it in {city}?", f"What is the time in {city} right now?",
                       f"Tell me the current time in {city}.", f"Current time in {city}?",
                       f"What is the date and time in {city}?"])
    if not tools:
        return Exchange(user, [_assistant(
            f"I cannot check the clock from here. {city} uses the time zone {tz}.")], "time")
    base = dt.datetime(2025, 1, 1) + dt.timedelta(minutes=rng.randrange(365 * 24 * 60))
    off = UTC_OFFSETS[tz]
    local = base + dt.timedelta(hours=off)
    stamp = local.strftime("%Y-%m-%dT%H:%M:%S") + f"{'+' if off >= 0 else '-'}{abs(off):02d}:00"
    call = {"name": "get_current_time", "arguments": {"timezone": tz}}
    result = json.dumps({"timezone": tz, "datetime": stamp})
    answer = f"It is {local.strftime('%H:%M')} in {city} on {local.date().isoformat()}."
    return Exchange(user, [
        _assistant("", f"The user wants the time in {city}. The time zone is {tz}.", [call]),
        {"role": "tool", "content": result},
        _assistant(answer),
    ], "time", True, call)


def _file_content(rng: random.Random, stem: str) -> str:
    if stem in ("shopping", "groceries", "list"):
        return "\n".join(f"- {w}" for w in rng.sample(FILE_WORDS, rng.randint(2, 5)))
    if stem in ("todo", "tasks", "plan", "reminders", "week"):
        return "\n".join(f"{i + 1}. {t}" for i, t in enumerate(rng.sample(TODO_ITEMS, rng.randint(2, 4))))
    return "\n".join(rng.sample(NOTE_LINES, rng.randint(1, 3)))


def read_file(rng: random.Random, tools: bool) -> Exchange:
    stem = rng.choice(FILE_STEMS)
    path = stem + rng.choice(FILE_EXTS)
    if rng.random() < 0.25:
        path = f"{stem}_{rng.randint(1, 9)}{rng.choice(FILE_EXTS)}"
    user = _pick(rng, [f"What is in {path}?", f"Read {path} for me.", f"Show me the file {path}.",
                       f"Open {path} and tell me what it says.", f"Can you read {path}?"])
    if not tools:
        return Exchange(user, [_assistant(
            f"I cannot open files from here. If you paste the text of {path}, I can help with it.")], "file")
    call = {"name": "read_file", "arguments": {"path": path}}
    if rng.random() < 0.12:
        result = json.dumps({"error": f"file not found: {path}"})
        answer = f"I could not find {path} in the sandbox folder."
    else:
        result = _file_content(rng, stem)
        answer = f"Here is what {path} says:\n\n{result}"
    return Exchange(user, [
        _assistant("", f"The user wants the file {path}. I will read it.", [call]),
        {"role": "tool", "content": result},
        _assistant(answer),
    ], "file", True, call)


TOPICS = {
    "small_talk": (small_talk, 0.16), "arithmetic": (arithmetic, 0.14), "units": (units, 0.12),
    "dates": (dates, 0.10), "code": (code, 0.09), "lists_tables": (lists_tables, 0.11),
    "time": (time_query, 0.14), "file": (read_file, 0.14),
}
TOOL_TOPICS = ("arithmetic", "units", "time", "file")


# --------------------------------------------------------------------------- conversations
@dataclass
class Conversation:
    """One rendered dialogue; `messages` and `tools` as passed to the chat template."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    exchanges: list[Exchange] = field(default_factory=list)

    @property
    def last(self) -> Exchange:
        return self.exchanges[-1]


def conversation_seed(split: str, index: int, base_seed: int = BASE_SEED) -> int:
    h = hashlib.sha256(f"{base_seed}/{split}/{index}".encode()).digest()
    return int.from_bytes(h[:8], "little")


def make_conversation(split: str, index: int, base_seed: int = BASE_SEED,
                      topic_weights: dict[str, float] | None = None) -> Conversation:
    """topic_weights: override some topics' weights (a later training stage's mix); None: TOPICS."""
    rng = random.Random(conversation_seed(split, index, base_seed))
    with_tools = rng.random() < 0.55
    n_turns = rng.choices([1, 2, 3], weights=[0.5, 0.35, 0.15])[0]
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    names = list(TOPICS)
    weights = [(topic_weights or {}).get(n, TOPICS[n][1]) for n in names]
    exchanges = []
    for _ in range(n_turns):
        topic = rng.choices(names, weights=weights)[0]
        ex = TOPICS[topic][0](rng, with_tools)
        exchanges.append(ex)
        messages.append({"role": "user", "content": ex.user})
        messages.extend(ex.replies)
    return Conversation(messages, TOOLS if with_tools else None, exchanges)


# --------------------------------------------------------------------------- rendering
def _jinja_env():
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


_TEMPLATE = None


def chat_template_text() -> str:
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def render(messages: list[dict[str, Any]], tools: list | None = None, add_generation_prompt: bool = False,
           enable_thinking: bool = True) -> str:
    """Render like transformers' apply_chat_template (jinja2 sandbox, trim/lstrip blocks, tojson)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        _TEMPLATE = _jinja_env().from_string(chat_template_text())
    kwargs: dict[str, Any] = {"messages": messages, "tools": tools,
                              "add_generation_prompt": add_generation_prompt}
    if not enable_thinking:
        kwargs["enable_thinking"] = False
    return _TEMPLATE.render(**kwargs)


def render_conversation(conv: Conversation) -> str:
    return render(conv.messages, conv.tools)


@dataclass
class EvalPrompt:
    """A held-out prompt: the conversation cut before the last exchange's first assistant turn."""
    text: str                 # rendered prompt ending with the generation prompt
    expects_tool: bool
    expected_call: dict[str, Any] | None
    kind: str
    has_tools: bool
    user: str


def eval_prompt(conv: Conversation) -> EvalPrompt:
    # Cut right after the last user message: earlier exchanges stay as history.
    last_user = max(i for i, m in enumerate(conv.messages) if m["role"] == "user")
    text = render(conv.messages[: last_user + 1], conv.tools, add_generation_prompt=True)
    ex = conv.last
    return EvalPrompt(text, ex.uses_tool, ex.tool_call, ex.kind, conv.tools is not None, ex.user)


def split_sizes() -> dict[str, int]:
    return {"train": 60000, "test": 600}


def corpus_texts(split: str, n: int, base_seed: int = BASE_SEED,
                 topic_weights: dict[str, float] | None = None) -> list[str]:
    return [render_conversation(make_conversation(split, i, base_seed, topic_weights)) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="Write the demo corpus (one JSON string per line).")
    p.add_argument("--split", default="train")
    p.add_argument("-n", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    n = a.n if a.n is not None else split_sizes()[a.split]
    with a.out.open("w", encoding="utf-8") as fh:
        for text in corpus_texts(a.split, n):
            fh.write(json.dumps(text, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
