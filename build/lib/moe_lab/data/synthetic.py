"""Synthetic arithmetic word problems with chain-of-thought answers (offline stand-in for math data)."""

from __future__ import annotations

import random

_PEOPLE = [
    ("Alice", "she", "her"),
    ("Bob", "he", "him"),
    ("Carmen", "she", "her"),
    ("David", "he", "him"),
    ("Emma", "she", "her"),
    ("Farid", "he", "him"),
    ("Grace", "she", "her"),
    ("Hiro", "he", "him"),
    ("Ines", "she", "her"),
    ("Jamal", "he", "him"),
    ("Kofi", "he", "him"),
    ("Lena", "she", "her"),
]
_OBJECTS = [
    "apples",
    "marbles",
    "stickers",
    "books",
    "pencils",
    "cookies",
    "coins",
    "shells",
    "cards",
    "stamps",
]
_CONTAINERS = ["bags", "boxes", "jars", "packs"]


def _problem(rng: random.Random) -> dict:
    name, subj, obj = rng.choice(_PEOPLE)
    subj_cap = subj.capitalize()
    thing = rng.choice(_OBJECTS)
    n_ops = rng.randint(1, 3)
    if rng.random() < 0.5:  # start with a product: counts as the first operation
        k, m = rng.randint(2, 6), rng.randint(2, 9)
        box = rng.choice(_CONTAINERS)
        value, expr = k * m, f"({k} * {m})"
        story = [f"{name} has {k} {box} with {m} {thing} in each."]
        steps = [f"{name} has {k} {box} of {m} {thing}, so {k} * {m} = {value} {thing}."]
        n_ops -= 1
    else:
        value = rng.randint(2, 20)
        expr = str(value)
        story = [f"{name} has {value} {thing}."]
        steps = [f"{name} starts with {value} {thing}."]
    for _ in range(n_ops):
        op = rng.choice("+-*")
        if op == "-" and value < 2:
            op = "+"
        if op == "*" and value > 40:
            op = "-"
        if op == "+":
            b = rng.randint(1, 20)
            new = value + b
            story.append(
                rng.choice(
                    [
                        f"{subj_cap} buys {b} more {thing}.",
                        f"A friend gives {obj} {b} more {thing}.",
                        f"{subj_cap} finds {b} {thing}.",
                    ]
                )
            )
            steps.append(f"After getting {b} more, {subj} has {value} + {b} = {new}.")
        elif op == "-":
            b = rng.randint(1, value - 1)
            new = value - b
            story.append(
                rng.choice(
                    [
                        f"{subj_cap} gives {b} {thing} to a friend.",
                        f"{subj_cap} loses {b} {thing}.",
                        f"{subj_cap} uses {b} {thing}.",
                    ]
                )
            )
            steps.append(f"After losing {b}, {subj} has {value} - {b} = {new}.")
        else:
            b = rng.randint(2, 4)
            new = value * b
            story.append(f"Then the number of {thing} {subj} has becomes {b} times as large.")
            steps.append(f"{b} times as many is {value} * {b} = {new}.")
        value, expr = new, f"({expr} {op} {b})"
    question = rng.choice(
        [f"How many {thing} does {name} have now?", f"How many {thing} does {name} have in the end?"]
    )
    return {
        "instruction": " ".join(story + [question]),
        "input": "",
        "output": " ".join(steps + [f"The answer is {value}."]),
        "answer": str(value),
        "expression": expr,
    }


def synthetic_math_rows(n: int, seed: int) -> list[dict]:
    """``n`` arithmetic word problems (1-3 of +, -, * on small integers), deterministic per ``seed``.

    Each row: ``instruction``, ``input`` (""), ``output`` (step-by-step, ends with "The answer is N."),
    ``answer`` ("N") and ``expression`` (fully parenthesised arithmetic whose value is N).
    """
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(n)]
