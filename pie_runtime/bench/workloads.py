"""Multi-request workloads of `pie bench speculation --workload`: many requests run one after the other in ONE
process, as an inferlet host runs them, so what inferlets share across runs (``Model.shared``: the suffix
drafter's store of earlier outputs) fills as it would under `pie serve`.

    json-facts   N chat requests that each fill the same JSON shape about a different item (a fixed list of
                 items, shuffled by the seed): structure repeats across requests, the content does not
    code-classes N chat requests that each ask for the same small Python class about a different entity and pair of
                 fields (the code a coding assistant writes again and again: constructor, accessors, the example
                 and the explanation after it): long spans repeat across requests, only names and fields change
    mixed-text   N ordinary varied requests (a form × a topic, drawn by the seed): the control, where drafting
                 from earlier outputs has little to copy

``run_workload`` runs the inferlets in turns, request by request (text-completion, cacheback, suffix for
request 1, then for request 2, ...), so a machine that slows down during the run slows all alike.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WORKLOADS = ("json-facts", "code-classes", "mixed-text")

ITEMS = (
    "apple",
    "banana",
    "cherry",
    "mango",
    "pineapple",
    "lemon",
    "strawberry",
    "watermelon",
    "coconut",
    "avocado",
    "lion",
    "tiger",
    "elephant",
    "giraffe",
    "penguin",
    "dolphin",
    "eagle",
    "wolf",
    "koala",
    "octopus",
    "Paris",
    "Tokyo",
    "Cairo",
    "Sydney",
    "Toronto",
    "Lima",
    "Oslo",
    "Nairobi",
    "Mumbai",
    "Rome",
    "copper",
    "gold",
    "iron",
    "silver",
    "oxygen",
    "helium",
    "carbon",
    "neon",
    "oak",
    "maple",
    "cactus",
    "bamboo",
    "rose",
    "tulip",
    "sunflower",
    "fern",
    "violin",
    "piano",
    "guitar",
    "drum",
    "flute",
    "trumpet",
    "harp",
    "cello",
)

JSON_FACTS = (
    "Describe {item} as one JSON object with exactly these fields: "
    '"name" (string), "category" (string), "color" (string), "origin" (string), "size" (string), '
    '"fun_fact" (string). Answer with the JSON object only.'
)

CODE_CLASS = (
    "Write a Python class named {name} that stores {a} and {b}, with a method {method}() that returns a sentence "
    "about them and a method set_{b}() that changes the {b}. Answer with the code only."
)
ENTITIES = (
    ("Dog", "name", "age"),
    ("Student", "name", "grade"),
    ("Car", "model", "speed"),
    ("Book", "title", "pages"),
    ("Employee", "name", "salary"),
    ("Planet", "name", "radius"),
    ("Account", "owner", "balance"),
    ("Recipe", "title", "servings"),
    ("Movie", "title", "rating"),
    ("Product", "name", "price"),
    ("City", "name", "population"),
    ("Song", "title", "length"),
    ("Teacher", "name", "subject"),
    ("Bicycle", "brand", "gears"),
    ("Room", "name", "area"),
    ("Team", "name", "score"),
    ("Tree", "species", "height"),
    ("Phone", "brand", "battery"),
    ("Course", "title", "credits"),
    ("Ship", "name", "tonnage"),
    ("Museum", "name", "visitors"),
    ("Garden", "owner", "size"),
    ("Robot", "model", "power"),
    ("Painting", "artist", "year"),
)
METHODS = ("describe", "summary", "info")  # x ENTITIES: 72 distinct requests

FORMS = (
    "Write a short story about {t}.",
    "Explain to a child how {t} works.",
    "Write a poem about {t}.",
    "Give some advice about {t}.",
    "Describe a day in the life of {t}.",
    "What would happen if {t} disappeared?",
    "Argue for and against {t}.",
    "Write a letter to a friend about {t}.",
)
TOPICS = (
    "the ocean",
    "a lighthouse keeper",
    "rain",
    "the moon",
    "a bakery",
    "trains",
    "learning to swim",
    "an old clock",
    "winter",
    "a robot",
    "bees",
    "volcanoes",
    "a library",
    "chess",
    "mountains",
    "coffee",
)


def prompts(workload: str, n: int, seed: int = 0) -> list[str]:
    """The workload's ``n`` request prompts (chat messages' content), the same for the same seed."""
    rng = random.Random(seed)
    if workload == "json-facts":
        return [JSON_FACTS.format(item=item) for item in _drawn(ITEMS, n, rng)]
    if workload == "code-classes":
        asks = _drawn([(e, m) for m in METHODS for e in ENTITIES], n, rng)
        return [CODE_CLASS.format(name=e[0], a=e[1], b=e[2], method=m) for e, m in asks]
    if workload == "mixed-text":
        return [form.format(t=topic) for form, topic in _drawn([(f, t) for f in FORMS for t in TOPICS], n, rng)]
    raise ValueError(f"no workload {workload!r}; one of {', '.join(WORKLOADS)}")


def _drawn(pool: Sequence[Any], n: int, rng: random.Random) -> list[Any]:
    """``n`` of ``pool`` in an order shuffled by ``rng``, starting over when the pool runs out."""
    order = list(pool)
    rng.shuffle(order)
    return [order[i % len(order)] for i in range(n)]


def run_workload(
    address: str, runs: list[tuple[str, Path, list[str]]], texts: list[str], progress: bool = False
) -> dict[str, list[dict]]:
    """Runs every (label, inferlet file, argument words) on every prompt, in turns, in this process and on one
    connection to the engine at ``address``; returns each label's results in prompt order. ``progress``: a line
    on stderr after each run."""
    return asyncio.run(_run_all(address, runs, texts, progress))


async def _run_all(
    address: str, runs: list[tuple[str, Path, list[str]]], texts: list[str], progress: bool
) -> dict[str, list[dict]]:
    from inferlet.runtime import connect, jsonable, load_module, run_in_context
    from inferlet.text.arguments import parse_args

    entries = {label: load_module(path, f"bench_{label.replace('-', '_')}")[1] for label, path, _ in runs}
    session = await connect(address)
    out: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    try:
        for i, text in enumerate(texts):
            for label, path, words in runs:
                fn = entries[label]
                args = parse_args(["--prompt", text, "--stream", "false", *words], fn)
                result: Any = await run_in_context(fn, args, session=session, inferlet=path.stem, sink=_drop)
                out[label].append(jsonable(result))
                if progress:
                    rate = result["stats"].get("decode_tokens_per_s", 0.0)
                    print(f"[{i + 1}/{len(texts)}] {label}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        session.close()
    return out


def _drop(_text: str, _logprobs: list[dict] | None = None) -> None:
    """Streamed text goes nowhere: the results carry it."""
