"""Chat prompts built from templates (topic x instruction x format) for MTP self-distillation.

No downloaded data: the target answers these prompts itself. Training and held-out prompts
use disjoint topic lists, so an evaluation on held-out prompts never sees a training topic.
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


def _prompts(topics: list[str], count: int, seed: int) -> list[str]:
    combos = list(itertools.product(topics, INSTRUCTIONS, FORMATS))
    random.Random(seed).shuffle(combos)
    return [instruction.format(topic=topic) + fmt for topic, instruction, fmt in combos[:count]]


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct user messages (at most topics x instructions x formats) on training topics."""
    return _prompts(TRAIN_TOPICS, count, seed)


def held_out_prompts(count: int, seed: int = 1) -> list[str]:
    """User messages on topics that no training prompt mentions."""
    return _prompts(HELD_OUT_TOPICS, count, seed)


def as_chat(prompts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p}] for p in prompts]
