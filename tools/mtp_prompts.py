"""Chat prompts built from templates (topic x instruction x format) for MTP self-distillation.

No downloaded data: the target answers these prompts itself. Training and held-out prompts
use disjoint topic lists, so an evaluation on held-out prompts never sees a training topic.
A share of the training prompts ask to copy or lightly edit a text given in the prompt (a
record, a code snippet, a passage): answers that repeat context, where speculation pays most
and which explanations alone never show the head.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

TRAIN_TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "the water cycle",
    "machine learning", "volcanoes", "the Roman Empire", "climate change", "vaccines", "the stock market",
    "electric cars", "honey bees", "the human heart", "quantum computing", "the Great Wall of China",
    "recycling", "the Moon landing", "jazz music", "chess openings", "coffee brewing", "sourdough bread",
    "marathon training", "meditation", "the printing press", "rainforests", "earthquakes", "solar panels",
    "the internet", "DNA", "the Olympic Games", "dinosaurs", "the Renaissance", "time management",
    "public speaking", "gardening tomatoes", "learning a new language", "cloud computing", "sleep hygiene",
    "the immune system", "hash tables", "sorting algorithms", "recursion in programming", "SQL joins",
    "Python decorators", "version control with git", "the theory of evolution", "ocean tides",
    "the periodic table", "supply and demand", "inflation", "the Industrial Revolution", "origami",
    "bird migration", "the Amazon river", "mountain climbing", "writing a resume", "job interviews",
    "healthy breakfast ideas", "budgeting", "the solar system", "artificial satellites", "wind energy",
    "ancient Egypt", "Shakespeare", "the Pythagorean theorem", "prime numbers", "probability",
    "the scientific method", "electric circuits", "magnets", "cats as pets", "training a puppy",
]
HELD_OUT_TOPICS = [
    "glaciers", "the Silk Road", "coral reefs", "lighthouses", "the violin", "tea ceremonies",
    "bicycle maintenance", "the Eiffel Tower", "penguins", "linked lists", "the binary number system",
    "mushrooms", "hot air balloons", "the Apollo program", "desert plants", "museums",
]
INSTRUCTIONS = [
    "Explain {topic} to a ten-year-old.", "What is {topic}?", "Give me three facts about {topic}.",
    "Write a short paragraph about {topic}.", "Why does {topic} matter?", "Summarize the history of {topic}.",
    "What are common misconceptions about {topic}?", "Describe {topic} in simple terms.",
    "List the pros and cons of {topic}.", "Write a short poem about {topic}.",
    "How would you teach {topic} to a beginner?", "Compare {topic} with something from everyday life.",
    "Give me a quiz question about {topic} and its answer.", "Tell me a short story that involves {topic}.",
    "What are the key ideas behind {topic}?", "Write a tweet about {topic}.",
]
FORMATS = [
    "", " Answer in one sentence.", " Use a numbered list.", " Keep it under 50 words.", " Use bullet points.",
    " Be detailed.", " Write it as a dialogue.", " End with a question.",
]


COPY_INSTRUCTIONS = [
    "Copy this {kind} exactly:\n{text}", "Return this {kind} unchanged, with no comment:\n{text}",
    "Here is a {kind}. Write it out again word for word.\n{text}",
    "Rewrite this {kind}, changing nothing:\n{text}", "Repeat the following {kind} verbatim.\n{text}",
]
_ITEMS = ["lamp", "kettle", "backpack", "notebook", "scarf", "helmet", "blender", "tent", "jacket", "drill"]
_COLOURS = ["red", "blue", "green", "black", "white", "orange", "grey", "yellow"]
_VERBS = ["counts", "filters", "merges", "sorts", "groups", "checks", "loads", "cleans"]


def _record_text(rng: random.Random) -> str:
    """One JSON object: flat fields, sometimes a nested object and a list (the shapes of API payloads)."""
    item = rng.choice(_ITEMS)
    fields = [f'"sku": "{item[:3].upper()}-{rng.randint(100, 999)}"', f'"product": "{rng.choice(_COLOURS)} {item}"',
              f'"price": {rng.randint(5, 400)}.{rng.randint(0, 99):02d}', f'"stock": {rng.randint(0, 90)}',
              f'"warehouse": "W{rng.randint(1, 9)}"', f'"on_sale": {rng.choice(["true", "false"])}']
    if rng.random() < 0.5:
        colours = ", ".join(f'"{c}"' for c in rng.sample(_COLOURS, rng.randint(1, 3)))
        fields.append(f'"colours": [{colours}]')
    if rng.random() < 0.5:
        fields.append(f'"size": {{"width": {rng.randint(5, 90)}, "height": {rng.randint(5, 90)}, '
                      f'"unit": "{rng.choice(["cm", "mm", "in"])}"}}')
    return "{" + ", ".join(rng.sample(fields, rng.randint(3, len(fields)))) + "}"


def _records_text(rng: random.Random) -> str:
    """A JSON array of a few records: a long answer whose records repeat each other's keys."""
    return "[" + ", ".join(_record_text(rng) for _ in range(rng.randint(2, 4))) + "]"


def _function_text(rng: random.Random) -> str:
    verb, noun = rng.choice(_VERBS), rng.choice(_ITEMS)
    limit = rng.randint(2, 50)
    bodies = [
        f"    kept = []\n    for row in rows:\n        if row.get(\"{noun}\") and len(kept) < limit:\n"
        f"            kept.append(row)\n    return kept\n",
        f"    total = 0\n    for row in rows[:limit]:\n        total += row[\"{noun}\"]\n    return total\n",
        f"    seen = {{}}\n    for row in rows:\n        key = row.get(\"{noun}\", None)\n"
        f"        seen[key] = seen.get(key, 0) + 1\n    return sorted(seen.items())[:limit]\n",
    ]
    return f"def {verb}_{noun}s(rows, limit={limit}):\n" + rng.choice(bodies)


def _code_text(rng: random.Random) -> str:
    """One to three functions."""
    return "\n\n".join(_function_text(rng) for _ in range(rng.randint(1, 3)))


def _passage_text(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 3)):
        topics = rng.sample(TRAIN_TOPICS, 3)
        sentences.append(f"Notes on {topics[0]}: it connects to {topics[1]} in more ways than one might expect, "
                         f"and both say something about {topics[2]}.")
    return " ".join(sentences)


# Words the random payloads draw keys and values from: broad, so that the head learns to copy
# whatever a prompt holds rather than the few keys of one generator.
_WORDS = [
    "account", "action", "address", "amount", "area", "author", "balance", "batch", "branch", "budget",
    "cache", "category", "channel", "city", "client", "code", "color", "comment", "count", "country",
    "created", "currency", "customer", "date", "deadline", "department", "description", "device", "discount",
    "distance", "domain", "duration", "email", "enabled", "event", "expires", "file", "flag", "format",
    "group", "height", "host", "id", "image", "index", "invoice", "item", "key", "label", "language",
    "level", "limit", "link", "location", "manager", "message", "method", "mode", "model", "name", "note",
    "number", "order", "owner", "page", "parent", "path", "payment", "phone", "plan", "port", "position",
    "price", "priority", "project", "quantity", "rating", "reason", "region", "role", "score", "section",
    "sender", "session", "size", "source", "stage", "state", "status", "street", "student", "subject",
    "tag", "target", "team", "title", "token", "total", "type", "unit", "updated", "user", "value",
    "vendor", "version", "weight", "width", "year", "zone",
]
_FIRST_NAMES = ["Ada", "Bruno", "Chen", "Dana", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemi",
                "Luca", "Maya", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera"]
_LAST_NAMES = ["Alvarez", "Berg", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ito",
               "Jensen", "Kowalski", "Larsen", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Silva"]
_PLACES = ["Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Lima", "Austin", "Hanoi", "Oslo", "Cairo",
           "Leeds", "Perth", "Bogota", "Munich", "Seoul", "Dakar"]


def _identifier(rng: random.Random) -> str:
    """A snake_case name of one or two words."""
    return "_".join(rng.sample(_WORDS, rng.choice([1, 1, 2])))


# Each value kind's text, from the generator and a person's first and last name (which `_scalar`
# draws for every value, so that the stream of draws does not depend on the kind).
_SCALARS: dict[str, Callable[[random.Random, str, str], str]] = {
    "int": lambda rng, first, last: str(rng.randint(0, 10 ** rng.randint(1, 6))),
    "float": lambda rng, first, last: f"{rng.uniform(0, 1000):.{rng.randint(1, 3)}f}",
    "bool": lambda rng, first, last: rng.choice(["true", "false"]),
    "null": lambda rng, first, last: "null",
    "word": lambda rng, first, last: f'"{rng.choice(_WORDS)}"',
    "phrase": lambda rng, first, last: '"' + " ".join(rng.sample(_WORDS, rng.randint(2, 5))) + '"',
    "name": lambda rng, first, last: f'"{first} {last}"',
    "email": lambda rng, first, last: f'"{first.lower()}.{last.lower()}{rng.randint(1, 99)}@{rng.choice(_WORDS)}.org"',
    "place": lambda rng, first, last: f'"{rng.choice(_PLACES)}"',
    "date": lambda rng, first, last: f'"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"',
    "url": lambda rng, first, last: (f'"https://{rng.choice(_WORDS)}.example.com/'
                                     f'{rng.choice(_WORDS)}/{rng.randint(1, 999)}"'),
    "phone": lambda rng, first, last: f'"+{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"',
    "hex": lambda rng, first, last: '"' + "".join(rng.choice("0123456789abcdef")
                                                 for _ in range(rng.choice([8, 12, 16]))) + '"',
    "code": lambda rng, first, last: f'"{rng.choice(_WORDS)[:3].upper()}-{rng.randint(10, 99999)}"',
}
_SCALAR_KINDS = list(_SCALARS)


def _scalar(rng: random.Random, kind: str) -> str:
    """One JSON value of `kind`, as text."""
    first, last = rng.choice(_FIRST_NAMES), rng.choice(_LAST_NAMES)
    return _SCALARS[kind](rng, first, last)


def _schema(rng: random.Random, depth: int = 0) -> list[tuple[str, object]]:
    """Keys with a value kind each: a scalar kind, a list of one, or (at depths 0 and 1) a nested schema."""
    fields: list[tuple[str, object]] = []
    for key in dict.fromkeys(_identifier(rng) for _ in range(rng.randint(2, 8 if depth == 0 else 4))):
        roll = rng.random()
        if roll < 0.12 and depth < 2:
            fields.append((key, _schema(rng, depth + 1)))
        elif roll < 0.22:
            fields.append((key, ("list", rng.choice(_SCALAR_KINDS))))
        else:
            fields.append((key, rng.choice(_SCALAR_KINDS)))
    return fields


def _instance(rng: random.Random, schema: list[tuple[str, object]]) -> str:
    parts = []
    for key, kind in schema:
        if isinstance(kind, list):
            value = _instance(rng, kind)
        elif isinstance(kind, tuple):
            value = "[" + ", ".join(_scalar(rng, kind[1]) for _ in range(rng.randint(0, 4))) + "]"
        else:
            value = _scalar(rng, str(kind))
        parts.append(f'"{key}": {value}')
    return "{" + ", ".join(parts) + "}"


def _payload_text(rng: random.Random) -> str:
    """A JSON object or an array of 1-6 objects of one random schema (keys and value kinds drawn
    from broad lists: names, emails, dates, URLs, ids, numbers, nested objects, lists)."""
    schema = _schema(rng)
    if rng.random() < 0.3:
        return _instance(rng, schema)
    return "[" + ", ".join(_instance(rng, schema) for _ in range(rng.randint(1, 6))) + "]"


def _table_text(rng: random.Random) -> str:
    """A CSV or Markdown table of random columns and 2-8 rows."""
    keys = dict.fromkeys(_identifier(rng) for _ in range(rng.randint(3, 6)))
    schema = [(key, rng.choice(_SCALAR_KINDS)) for key in keys]
    rows = [[_scalar(rng, kind).strip('"') for _, kind in schema] for _ in range(rng.randint(2, 8))]
    header = [key for key, _ in schema]
    if rng.random() < 0.5:
        return "\n".join(",".join(cells) for cells in [header] + rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def _config_text(rng: random.Random) -> str:
    """YAML-like settings: sections of `key: value` lines."""
    lines = []
    for _ in range(rng.randint(1, 3)):
        lines.append(f"{_identifier(rng)}:")
        lines += [f"  {key}: {_scalar(rng, rng.choice(_SCALAR_KINDS)).strip(chr(34))}"
                  for key in dict.fromkeys(_identifier(rng) for _ in range(rng.randint(2, 6)))]
    return "\n".join(lines)


def _log_text(rng: random.Random) -> str:
    """Log lines: timestamp, level, component and a message with values."""
    level = ["INFO", "WARN", "ERROR", "DEBUG"]
    return "\n".join(
        f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
        f"{rng.randint(0, 59):02d} {rng.choice(level)} {_identifier(rng)}: {' '.join(rng.sample(_WORDS, 3))} "
        f"{_identifier(rng)}={_scalar(rng, rng.choice(['int', 'hex', 'code', 'float']))}"
        for _ in range(rng.randint(2, 8)))


def _js_text(rng: random.Random) -> str:
    """A JavaScript function over random names."""
    fn, arg, field = _identifier(rng), rng.choice(_WORDS), rng.choice(_WORDS)
    camel = "".join(w.capitalize() if i else w for i, w in enumerate(fn.split("_")))
    return (f"function {camel}({arg}s, limit = {rng.randint(1, 100)}) {{\n  const out = [];\n"
            f"  for (const {arg} of {arg}s) {{\n    if ({arg}.{field} !== undefined && out.length < limit) {{\n"
            f"      out.push({arg}.{field});\n    }}\n  }}\n  return out;\n}}\n")


_COPY_SOURCES = [("JSON record", _record_text), ("JSON array", _records_text), ("Python code", _code_text),
                 ("passage", _passage_text), ("JSON", _payload_text), ("JSON", _payload_text),
                 ("JSON", _payload_text), ("table", _table_text), ("config", _config_text), ("log", _log_text),
                 ("JavaScript code", _js_text)]


def copy_prompts(count: int, seed: int) -> list[str]:
    """`count` distinct requests to repeat a generated record, code snippet or passage given in the prompt."""
    rng = random.Random(seed)
    prompts: dict[str, None] = {}  # insertion-ordered set
    while len(prompts) < count:
        kind, make = rng.choice(_COPY_SOURCES)
        prompts[rng.choice(COPY_INSTRUCTIONS).format(kind=kind, text=make(rng))] = None
    return list(prompts)


def _prompts(topics: list[str], count: int, seed: int) -> list[str]:
    combos = list(itertools.product(topics, INSTRUCTIONS, FORMATS))
    random.Random(seed).shuffle(combos)
    return [instruction.format(topic=topic) + fmt for topic, instruction, fmt in combos[:count]]


def training_prompts(count: int, seed: int = 0, copy_share: float = 0.35) -> list[str]:
    """`count` user messages: `copy_share` of them copy requests (`copy_prompts`), the rest distinct
    questions (at most topics x instructions x formats) on training topics, shuffled together."""
    copies = round(count * copy_share)
    prompts = _prompts(TRAIN_TOPICS, count - copies, seed) + copy_prompts(copies, seed)
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts(count: int, seed: int = 1) -> list[str]:
    """User messages on topics that no training prompt mentions."""
    return _prompts(HELD_OUT_TOPICS, count, seed)


def held_out_copy_prompts(count: int, seed: int = 1) -> list[str]:
    """Copy requests from a seed no training run uses by default (texts drawn apart from training's)."""
    return copy_prompts(count, seed + 10_000)


# The held-out sets by the name the evaluation scripts' `--prompts` takes.
HELD_OUT = {"chat": held_out_prompts, "copy": held_out_copy_prompts}


def as_chat(prompts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p}] for p in prompts]
