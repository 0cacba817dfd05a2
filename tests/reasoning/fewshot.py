"""Prompts that make the embedded (non-reasoning) model think in `<think>` tags, deterministically.

Greedy decoding copies the few-shot pattern: a short thought, `</think>`, then the answer
(`yes`/`no`) right after the marker. The marker comes out as its canonical tokens.
"""

COMPLETION_PROMPT = """Q: Is the sky blue?
A: <think>
The sky looks blue on a clear day.
</think>yes

Q: Is fire cold?
A: <think>
Fire burns and is hot.
</think>no

Q: Is ice cold?
A: <think>
"""

# The same thought, already closed in the prompt: the answer comes first.
CLOSED_PROMPT = COMPLETION_PROMPT + "Ice is cold.\n</think>"

CHAT_MESSAGES = [
    {"role": "system", "content": "Think inside <think></think>, then answer yes or no."},
    {"role": "user", "content": "Is the sky blue?"},
    {"role": "assistant", "content": "<think>\nThe sky looks blue on a clear day.\n</think>yes"},
    {"role": "user", "content": "Is fire cold?"},
    {"role": "assistant", "content": "<think>\nFire burns and is hot.\n</think>no"},
    {"role": "user", "content": "Is ice cold?"},
]

# Choices the model would not pick unconstrained: proof that the constraint held after the marker.
CHOICES = ["maybe", "unsure"]
