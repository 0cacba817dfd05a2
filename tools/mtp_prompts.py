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


_COPY_SOURCES = [("JSON record", _record_text), ("JSON array", _records_text), ("Python code", _code_text),
                 ("passage", _passage_text)]


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
