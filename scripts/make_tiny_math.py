"""Generate the bundled `tiny_math` task: short arithmetic word problems in the GSM8K schema.

    .venv/bin/python scripts/make_tiny_math.py   # writes src/grpo/assets/tiny_math/{train,test}.jsonl
    .venv/bin/python scripts/make_tiny_math.py --seed 1234 --train-size 12000 \
        --out-dir src/grpo/assets/tiny_math

Each row is `{"question": str, "answer": str}`; the answer is one terse equation per step and ends in
`#### <number>`, exactly like GSM8K, so the same reward functions serve both datasets:

    question: "Tom has 5 apples. He buys 3 more. Then he doubles his pile. How many apples does he have now?"
    answer:   "5+3=8\\n8*2=16\\n#### 16"

A problem is a running quantity that starts with one setup sentence and goes through 0-2 more operations
(1-3 equations in all). Numbers stay small (every operand and result below 100, every intermediate a
non-negative integer, divisions exact) so that a few-million-parameter model can learn the arithmetic.
40% of problems carry one distractor sentence with a number the solution must ignore (as in GSM-IC).
Train and test are drawn from the same distribution, which is large enough (and the train split
de-duplicated against the test split) that a model cannot pass the test by memorising the train split.
The output is a pure function of `--seed`: one `random.Random(seed)` drives everything.
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
        "Noah",
        "Ivan",
        "Kenji",
        "Luis",
        "Ethan",
        "Hugo",
        "Amir",
        "Owen",
        "Felix",
        "Diego",
        "Theo",
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
        "Chloe",
        "Rosa",
        "Grace",
        "Yuki",
        "Lena",
        "Ella",
        "Fatima",
        "Ruby",
        "Ines",
        "Hana",
    ],
}
POSSESSIVE = {"he": "his", "she": "her"}
OBJECT = {"he": "him", "she": "her"}
# (plural noun, container noun). Food items can also be eaten.
ITEMS = [
    ("apples", "baskets"),
    ("marbles", "jars"),
    ("stickers", "sheets"),
    ("pencils", "boxes"),
    ("books", "shelves"),
    ("coins", "purses"),
    ("shells", "buckets"),
    ("cards", "packs"),
    ("stamps", "albums"),
    ("balloons", "bunches"),
    ("crayons", "boxes"),
    ("beads", "bags"),
    ("toy cars", "crates"),
    ("flowers", "vases"),
    ("rocks", "bags"),
    ("buttons", "tins"),
]
FOODS = [
    ("cookies", "jars"),
    ("eggs", "cartons"),
    ("muffins", "trays"),
    ("candies", "bags"),
    ("oranges", "crates"),
    ("grapes", "bowls"),
    ("cupcakes", "boxes"),
    ("plums", "baskets"),
]

DISTRACTOR_RATE = 0.4
MAX_VALUE = 99  # cap on every intermediate result: two-digit arithmetic only


class Story:
    """A running quantity plus the sentences and equations that produced it."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.pronoun = rng.choice(["he", "she"])
        self.name = rng.choice(NAMES[self.pronoun])
        # The friend has the other pronoun so that "he"/"she" always points at the main character;
        # `other` is a third person who only appears in the final "together" question.
        self.friend = rng.choice(NAMES["she" if self.pronoun == "he" else "he"])
        self.other = rng.choice(
            [n for names in NAMES.values() for n in names if n not in (self.name, self.friend)]
        )
        self.is_food = rng.random() < 0.35
        self.item, self.container = rng.choice(FOODS if self.is_food else ITEMS)
        self.value = 0
        self.sentences: list[str] = []
        self.steps: list[str] = []

    @property
    def subj(self) -> str:
        return self.pronoun.capitalize()

    @property
    def pos(self) -> str:
        return POSSESSIVE[self.pronoun]

    @property
    def obj(self) -> str:
        return OBJECT[self.pronoun]

    def record(self, sentence: str, a: int, op: str, b: int, result: int) -> None:
        self.sentences.append(sentence)
        self.steps.append(f"{a}{op}{b}={result}")
        self.value = result


# --- setup sentences: each introduces the starting quantity with exactly one equation -----------------


def setup_containers(s: Story) -> None:
    n, per = s.rng.randint(2, 9), s.rng.randint(2, 9)
    s.record(f"{s.name} has {n} {s.container} with {per} {s.item} in each.", n, "*", per, n * per)


def setup_two_piles(s: Story) -> None:
    a, b = s.rng.randint(2, 40), s.rng.randint(2, 20)
    where = s.rng.choice(["on Monday", "in the morning", "at the market", "at school"])
    later = s.rng.choice(["on Tuesday", "in the afternoon", "at the park", "after lunch"])
    s.record(f"{s.name} gets {a} {s.item} {where} and {b} more {later}.", a, "+", b, a + b)


def setup_gift(s: Story) -> None:
    a, b = s.rng.randint(2, 40), s.rng.randint(2, 20)
    s.record(f"{s.name} has {a} {s.item}. {s.friend} gives {s.name} {b} more.", a, "+", b, a + b)


def setup_spent(s: Story) -> None:
    a = s.rng.randint(10, 50)
    b = s.rng.randint(1, min(a - 1, 20))
    verb = "eats" if s.is_food else s.rng.choice(["loses", "sells", "gives away"])
    s.record(f"{s.name} has {a} {s.item}. {s.subj} {verb} {b} of them.", a, "-", b, a - b)


def setup_times_friend(s: Story) -> None:
    a, k = s.rng.randint(2, 12), s.rng.randint(2, 4)
    s.record(
        f"{s.friend} has {a} {s.item}. {s.name} has {k} times as many {s.item} as {s.friend}.",
        a,
        "*",
        k,
        a * k,
    )


def setup_compare(s: Story) -> None:
    a, b = s.rng.randint(5, 40), s.rng.randint(1, 20)
    if s.rng.random() < 0.5:
        s.record(
            f"{s.friend} has {a} {s.item}. {s.name} has {b} more {s.item} than {s.friend}.", a, "+", b, a + b
        )
    else:
        b = min(b, a - 1)
        s.record(
            f"{s.friend} has {a} {s.item}. {s.name} has {b} fewer {s.item} than {s.friend}.", a, "-", b, a - b
        )


SETUPS = [setup_containers, setup_two_piles, setup_gift, setup_spent, setup_times_friend, setup_compare]


# --- follow-up operations on the running quantity; each returns False when it does not fit ------------


def op_add(s: Story) -> bool:
    b = s.rng.randint(1, 20)
    if s.value + b > MAX_VALUE:
        return False
    sentence = s.rng.choice(
        [
            f"Then {s.pronoun} buys {b} more.",
            f"{s.subj} finds {b} more {s.item}.",
            f"{s.friend} gives {s.obj} {b} more.",
            f"Later {s.pronoun} gets {b} more.",
        ]
    )
    s.record(sentence, s.value, "+", b, s.value + b)
    return True


def op_sub(s: Story) -> bool:
    if s.value < 2:
        return False
    b = s.rng.randint(1, min(s.value - 1, 20))
    verbs = ["eats", "gives away", "drops"] if s.is_food else ["gives away", "loses", "sells"]
    sentence = s.rng.choice(
        [
            f"Then {s.pronoun} {s.rng.choice(verbs)} {b}.",
            f"{s.subj} gives {b} to {s.friend}.",
            f"After that {s.pronoun} uses {b} of them.",
        ]
    )
    s.record(sentence, s.value, "-", b, s.value - b)
    return True


def op_mul(s: Story) -> bool:
    k = s.rng.choice([2, 2, 3, 3, 4])
    if s.value * k > MAX_VALUE:
        return False
    word = {2: "doubles", 3: "triples"}.get(k)
    sentence = (
        f"Then {s.pronoun} {word} {s.pos} pile."
        if word and s.rng.random() < 0.6
        else f"{s.subj} ends up with {k} times as many {s.item}."
    )
    s.record(sentence, s.value, "*", k, s.value * k)
    return True


def op_half(s: Story) -> bool:
    if s.value < 2 or s.value % 2:
        return False
    s.record(f"Then {s.pronoun} gives half of them to {s.friend}.", s.value, "/", 2, s.value // 2)
    return True


FOLLOW_UPS = [op_add, op_sub, op_mul, op_half]


# --- final questions: most ask for the running total, some add one last (division or total) step ----


def ask_total(s: Story) -> bool:
    s.sentences.append(
        s.rng.choice(
            [
                f"How many {s.item} does {s.pronoun} have now?",
                f"How many {s.item} does {s.name} have in the end?",
            ]
        )
    )
    return True


def ask_share(s: Story) -> bool:
    divisors = [k for k in range(2, 10) if s.value % k == 0 and s.value // k >= 1]
    if not divisors or s.value == 0:
        return False
    k = s.rng.choice(divisors)
    s.sentences.append(
        f"{s.subj} puts them into {k} {s.container} equally. "
        f"How many {s.item} are in each of the {s.container}?"
    )
    s.steps.append(f"{s.value}/{k}={s.value // k}")
    s.value //= k
    return True


def ask_with_friend(s: Story) -> bool:
    b = s.rng.randint(1, 20)
    if s.value + b > MAX_VALUE:
        return False
    s.sentences.append(f"{s.other} has {b} {s.item}. How many {s.item} do they have together?")
    s.steps.append(f"{s.value}+{b}={s.value + b}")
    s.value += b
    return True


# --- distractors: a sentence with a number that the solution must ignore (as in GSM-IC) ---------------


def add_distractor(s: Story) -> None:
    n = s.rng.randint(2, 20)
    other_item = s.rng.choice([item for item, _ in ITEMS + FOODS if item != s.item])
    sentence = s.rng.choice(
        [
            f"{s.name} is {n} years old.",
            f"{s.friend} is {n} years old.",
            f"{s.name} also has {n} {other_item}.",
            f"{s.friend} has {n} {other_item}.",
            f"The shop is {n} minutes away.",
        ]
    )
    s.sentences.insert(s.rng.randint(0, len(s.sentences) - 1), sentence)  # anywhere before the question


def make_problem(rng: random.Random) -> dict[str, str]:
    num_steps = rng.choices([1, 2, 3], weights=[3, 4, 3])[0]
    while True:
        s = Story(rng)
        rng.choice(SETUPS)(s)
        final_is_step = num_steps > 1 and rng.random() < 0.3
        while len(s.steps) < num_steps - final_is_step:
            rng.choice(FOLLOW_UPS)(s)
        if (final_is_step and rng.choice([ask_share, ask_with_friend])(s)) or (
            not final_is_step and ask_total(s)
        ):
            break
    if rng.random() < DISTRACTOR_RATE:
        add_distractor(s)
    steps = "\n".join(s.steps)
    return {"question": " ".join(s.sentences), "answer": f"{steps}\n#### {s.value}"}


def generate(seed: int, train_size: int, test_size: int) -> tuple[list[dict], list[dict]]:
    """Draw unique problems (by question text); the first `test_size` become the held-out split."""
    return task_data.generate(make_problem, seed, train_size, test_size)


def main() -> None:
    task_data.main(
        __doc__.split("\n")[0],
        make_problem,
        seed=1234,
        train_size=12000,
        test_size=500,
        out_dir=Path(__file__).resolve().parents[1] / "src/grpo/assets/tiny_math",
    )


if __name__ == "__main__":
    main()
