"""Prompts of different lengths for the exactness tests: one over 1,000 tokens, and one over the
prefill chunk (2,048 tokens) so that a chunked prefill's KV is checked too."""

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


_SUBJECTS = ["The archivist", "A night train", "The old lighthouse", "Our survey team", "A migrating flock",
             "The village baker", "A copper mine", "The orchestra", "A glacier", "The harbour master", "A comet"]
_VERBS = ["recorded", "crossed", "outlasted", "mapped", "avoided", "supplied", "echoed", "measured", "carried"]
_OBJECTS = ["seven crates of maps", "the eastern ridge", "a storm of unusual strength", "forty wooden bridges",
            "the salt marshes", "a letter in green ink", "three lost compasses", "the winter festival"]
_PLACES = ["Lisbon", "the Andes", "the fjords of Bergen", "Samarkand", "the Nile delta", "Hokkaido", "Patagonia"]


def _essay(sentences: int) -> str:
    return " ".join(f"({i}) {_FACTS[i % len(_FACTS)]}" for i in range(sentences))


def _log(entries: int) -> str:
    """Varied, deterministic text: the lists' lengths are coprime-ish, so lines rarely repeat."""
    return "\n".join(
        f"Entry {i}: {_SUBJECTS[i % 11]} {_VERBS[(i * 5) % 9]} {_OBJECTS[(i * 3) % 8]} near "
        f"{_PLACES[(i * 2) % 7]} in {1800 + (i * 37) % 220}." for i in range(entries))


COMPLETION_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:\n",
    "Summarise the following notes in one sentence.\n" + _essay(8) + "\nSummary:",
    "Here are some facts.\n" + _essay(30) + "\nThe most surprising fact is",
    "Read this long list and answer the question at the end.\n" + _essay(90)
    + "\nQuestion: how many hearts does an octopus have?\nAnswer:",
    # ~2,500 tokens: longer than one prefill chunk (2,048), well inside max_model_len (8,192).
    "Below is a travel log.\n" + _log(100) + "\nQuestion: which city appears in entry 42?\nAnswer:",
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three colours."}],
    [{"role": "user", "content": "Explain these facts briefly:\n" + _essay(70)}],
]
