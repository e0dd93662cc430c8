"""Prompts of different lengths for the exactness tests (one over 1,000 tokens)."""

_FACTS = [
    "The river Danube flows through ten countries before reaching the Black Sea.",
    "Honey never spoils because its low moisture and acidity stop bacteria from growing.",
    "The first programmable computers filled whole rooms and used vacuum tubes.",
    "Octopuses have three hearts and blue blood rich in copper.",
    "Mount Everest grows a few millimetres each year as tectonic plates collide.",
    "The Great Library of Alexandria held scrolls from across the ancient world.",
    "Light from the Sun takes about eight minutes to reach the Earth.",
    "Bamboo can grow nearly a metre in a single day under good conditions.",
]


def _essay(sentences: int) -> str:
    return " ".join(f"({i}) {_FACTS[i % len(_FACTS)]}" for i in range(sentences))


COMPLETION_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:\n",
    "Summarise the following notes in one sentence.\n" + _essay(8) + "\nSummary:",
    "Here are some facts.\n" + _essay(30) + "\nThe most surprising fact is",
    "Read this long list and answer the question at the end.\n" + _essay(90)
    + "\nQuestion: how many hearts does an octopus have?\nAnswer:",
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three colours."}],
    [{"role": "user", "content": "Explain these facts briefly:\n" + _essay(70)}],
]
