"""Generate the bundled `tiny_tools` task: short arithmetic questions that need a calculator.

    .venv/bin/python scripts/make_tiny_tools.py   # writes src/grpo/assets/tiny_tools/{train,test}.jsonl

Each row is `{"question": str, "answer": str}` in the GSM8K schema, so the GSM8K reward and scorer apply;
the answer is the whole computation on one line (numbers in the order the question gives them), then the
final `#### <number>`:

    question: "Ana buys 23 boxes of 45 pens and 12 boxes of 67 pencils. How many things does she buy?"
    answer:   "23*45+12*67=1839\\n#### 1839"

The problems are ones the 2.8M-parameter bundled model cannot do in its head: a product of a 2- or 3-digit
number and a 2-digit number (bare, or in a short story), a sum of two such products, or a product less a
number. With the `calculator` tool (grpo.agents.calculator) they take one call (the whole expression) or
two (the first product, then the rest). Train and test come from one distribution, de-duplicated by
question text; the output is a pure function of `--seed` (one `random.Random` drives everything).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # task_data.py beside this file, however loaded
import task_data

NAMES = {
    "he": [
        "Tom",
        "Sam",
        "Leo",
        "Max",
        "Ben",
        "Omar",
        "Ravi",
        "Jack",
        "Liam",
        "Ivan",
        "Kenji",
        "Luis",
        "Hugo",
    ],
    "she": [
        "Anna",
        "Mia",
        "Lily",
        "Emma",
        "Zoe",
        "Sara",
        "Nina",
        "Ava",
        "Priya",
        "Maya",
        "Rosa",
        "Yuki",
        "Lena",
    ],
}
# (plural item, plural container, singular container)
PACKS = [
    ("pens", "boxes", "box"),
    ("apples", "crates", "crate"),
    ("eggs", "cartons", "carton"),
    ("cards", "packs", "pack"),
    ("stickers", "sheets", "sheet"),
    ("marbles", "bags", "bag"),
    ("books", "shelves", "shelf"),
    ("cookies", "trays", "tray"),
    ("stamps", "albums", "album"),
    ("beads", "jars", "jar"),
    ("nails", "tins", "tin"),
    ("bottles", "cases", "case"),
]
# (plural unit, plural group, what each group has): "a hall has 34 rows of 27 seats"
GRIDS = [
    ("seats", "rows", "A hall"),
    ("trees", "rows", "An orchard"),
    ("tiles", "rows", "A floor"),
    ("chairs", "rows", "A stadium"),
    ("windows", "floors", "A tower"),
    ("pages", "chapters", "A book"),
]


def two_digit(rng: random.Random) -> int:
    return rng.choice([n for n in range(11, 100) if n % 10])  # no round numbers: 30*x is too easy


def multiplicand(rng: random.Random) -> int:
    return two_digit(rng) if rng.random() < 0.5 else rng.choice([n for n in range(101, 1000) if n % 10])


def person(rng: random.Random) -> tuple[str, str, int]:
    pronoun = rng.choice(["he", "she"])
    return rng.choice(NAMES[pronoun]), pronoun


def product(rng: random.Random) -> tuple[str, str, int]:
    a, b = multiplicand(rng), two_digit(rng)
    if rng.random() < 0.35:
        question = rng.choice(
            [
                f"What is {a} times {b}?",
                f"What is {a} multiplied by {b}?",
                f"Compute {a} x {b}.",
                f"How much is {a} times {b}?",
                f"What is the product of {a} and {b}?",
            ]
        )
        return question, f"{a}*{b}", a * b
    name, pronoun = person(rng)
    item, containers, container = rng.choice(PACKS)
    unit, groups, place = rng.choice(GRIDS)
    question = rng.choice(
        [
            f"{name} has {a} {containers} with {b} {item} in each. How many {item} does {pronoun} have?",
            f"{place} has {a} {groups} of {b} {unit}. How many {unit} are there in all?",
            f"A {container} holds {a} {item}. How many {item} are in {b} {containers}?",
            f"{name} saves {a} dollars a week for {b} weeks. How many dollars does {pronoun} save?",
            f"A train moves {a} km every hour. How far does it go in {b} hours?",
        ]
    )
    return question, f"{a}*{b}", a * b


def sum_of_products(rng: random.Random) -> tuple[str, str, int]:
    a, b, c, d = two_digit(rng), two_digit(rng), two_digit(rng), two_digit(rng)
    if rng.random() < 0.3:
        return (
            rng.choice([f"What is {a}*{b} + {c}*{d}?", f"Compute {a} x {b} plus {c} x {d}."]),
            f"{a}*{b}+{c}*{d}",
            a * b + c * d,
        )
    name, pronoun = person(rng)
    (item1, cont1, _), (item2, cont2, _) = rng.sample(PACKS, 2)
    question = rng.choice(
        [
            f"{name} buys {a} {cont1} of {b} {item1} and {c} {cont2} of {d} {item2}. "
            f"How many things does {pronoun} buy in all?",
            f"A shop has {a} {cont1} with {b} {item1} each and {c} {cont2} with {d} {item2} each. "
            "How many things does it have?",
        ]
    )
    return question, f"{a}*{b}+{c}*{d}", a * b + c * d


def product_less(rng: random.Random) -> tuple[str, str, int]:
    a, b = multiplicand(rng), two_digit(rng)
    c = rng.randint(11, min(a * b - 1, 999))
    if rng.random() < 0.3:
        return (
            rng.choice([f"What is {a} times {b} minus {c}?", f"Compute {a}*{b} - {c}."]),
            f"{a}*{b}-{c}",
            a * b - c,
        )
    name, pronoun = person(rng)
    item, containers, _ = rng.choice(PACKS)
    question = rng.choice(
        [
            f"A shop has {a} {containers} of {b} {item}. It sells {c} {item}. How many {item} are left?",
            f"{name} has {a} {containers} with {b} {item} in each. {pronoun.capitalize()} gives away {c}. "
            f"How many {item} does {pronoun} keep?",
        ]
    )
    return question, f"{a}*{b}-{c}", a * b - c


KINDS = [(product, 0.55), (sum_of_products, 0.3), (product_less, 0.15)]


def make_problem(rng: random.Random) -> dict[str, str]:
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    question, expression, value = kind(rng)
    return {"question": question, "answer": f"{expression}={value}\n#### {value}"}


def generate(seed: int, train_size: int, test_size: int) -> tuple[list[dict], list[dict]]:
    """Draw unique problems (by question text); the first `test_size` become the held-out split."""
    return task_data.generate(make_problem, seed, train_size, test_size)


def main() -> None:
    task_data.main(
        __doc__.split("\n")[0],
        make_problem,
        seed=2026,
        train_size=6000,
        test_size=500,
        out_dir=Path(__file__).resolve().parents[1] / "src/grpo/assets/tiny_tools",
    )


if __name__ == "__main__":
    main()
