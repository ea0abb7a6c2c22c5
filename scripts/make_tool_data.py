"""Generate the math-tools rows of the tool-calling recipe: its questions and its SFT cold start (seeded).

Eight question families that a 135M model cannot answer in its head but one line of Python can (products of
4-digit numbers, sums of squares, modular powers, prime counts, greatest common divisors, digit sums of powers of
two, sums and differences of 5-digit numbers, ratios of factorials), the families of data/math-tools/train.jsonl.
Each family is asked in three wordings (WORDINGS); the cold start uses the first alone, the GRPO questions all
three, so GRPO trains and is evaluated on wordings the cold start never saw. Two files, as chat rows:

  data/math-tools/questions.jsonl   the questions GRPO trains on and evaluates (`id`, `messages`: a system
                                    message naming the tool and the call format, the question in one of its
                                    family's wordings, drawn at random; `ground_truth`)
  data/math-tools/cold-start.jsonl  the SFT cold start: conversations in which the assistant writes Python in a
                                    Hermes <tool_call>, reads the `tool` message with what the code printed, and
                                    answers in \\boxed{}; about one in six first writes code that fails, reads the
                                    error and calls again with the fix. Each row carries its `tools` list.

Every tool result is real: the code runs in the Python tool's bubblewrap sandbox (the recipe's limits) while the
data is made, and what it printed must equal the answer computed here, else the script fails. No cold-start
question is one of the questions of questions.jsonl or data/math-tools/train.jsonl (or asks for the same
numbers): whichever split a seed holds out, the cold start has never seen it.

    .venv/bin/python scripts/make_tool_data.py [--questions 160] [--trajectories 320] [--seed 11]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refiner_core.agent.hermes import hermes_block  # noqa: E402
from refiner_core.agent.tools.base import tool_schema  # noqa: E402

OUT = REPO / "data" / "math-tools"
EXCLUDED = (OUT / "train.jsonl",)  # the published recipe's questions: never in the cold start either
# Short on purpose: a CPU pays for the system message in every SFT and rollout token (Hermes' wording,
# refiner_core.agent.hermes.hermes_system_prompt, is about 200 tokens).
SYSTEM = (
    "Solve the math problem. You can run Python with the python tool: write\n"
    + hermes_block("python", {"code": "print(2 + 3)"})
    + "\nand read what it prints. When you know the answer, reply without a tool call and put the final answer "
    "in \\boxed{}."
)
CALL_LEADS = ("Let me compute it.", "I will compute this with Python.", "Let me run the calculation.")
FIX_LEADS = ("The code failed with {error}. Let me fix it.", "That raised {error}. Here is the corrected code.")
ANSWERS = ("The result is \\boxed{{{answer}}}.", "So the answer is \\boxed{{{answer}}}.", "\\boxed{{{answer}}}")
FAILING_SHARE = 1 / 6


@dataclass(frozen=True)
class Problem:
    family: str
    asked: tuple[int, ...]  # the numbers, in the order the question names them
    code: str  # prints the answer
    failing_code: str  # a plausible first try that raises
    answer: int
    question: str = ""  # the family's first wording unless reworded

    def __post_init__(self):
        if not self.question:
            object.__setattr__(self, "question", WORDINGS[self.family][0].format(*self.asked))

    @property
    def key(self) -> tuple:
        """Two problems with the same key ask for the same number, however worded."""
        return problem_key(self.family, self.asked)


def product(rng: random.Random) -> Problem:
    a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
    return Problem("product", (a, b), f"print({a} * {b})", f"print({a} x {b})", a * b)


def sum_of_squares(rng: random.Random) -> Problem:
    n = rng.randint(50, 400)
    return Problem(
        "sum_of_squares",
        (n,),
        f"print(sum(k * k for k in range(1, {n} + 1)))",
        "print(sum(k * k for k in range(1, n + 1)))",
        sum(k * k for k in range(1, n + 1)),
    )


MODULI = (97, 101, 103, 997, 1009, 1013)


def modular_power(rng: random.Random) -> Problem:
    b, e, m = rng.randint(3, 25), rng.randint(20, 70), rng.choice(MODULI)
    return Problem(
        "modular_power",
        (b, e, m),
        f"print(pow({b}, {e}, {m}))",
        f"print(pow({b}, {e}) mod {m})",
        pow(b, e, m),
    )


def prime_count(rng: random.Random) -> Problem:
    n = rng.randint(300, 2000)
    return Problem(
        "prime_count",
        (n,),
        f"print(sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) for k in range(2, {n})))",
        f"print(sum(isprime(k) for k in range(2, {n})))",
        sum(all(k % d for d in range(2, int(k**0.5) + 1)) for k in range(2, n)),
    )


def gcd(rng: random.Random) -> Problem:
    g = rng.choice((1, 2, 3, 6, 7, 9, 12, 30, 45))
    a, b = g * rng.randint(200, 4000), g * rng.randint(200, 4000)
    return Problem(
        "gcd",
        (a, b),
        f"import math\nprint(math.gcd({a}, {b}))",
        f"print(math.gcd({a}, {b}))",
        math.gcd(a, b),
    )


def digit_sum(rng: random.Random) -> Problem:
    n = rng.randint(60, 300)
    return Problem(
        "digit_sum",
        (n,),
        f"print(sum(int(d) for d in str(2 ** {n})))",
        f"print(sum(int(d) for d in 2 ** {n}))",
        sum(int(d) for d in str(2**n)),
    )


def add_subtract(rng: random.Random) -> Problem:
    a, b, c = rng.randint(10000, 99999), rng.randint(10000, 99999), rng.randint(10000, 99999)
    return Problem(
        "add_subtract",
        (a, b, c),
        f"print({a} + {b} - {c})",
        f"print({a} + {b} - {c}",
        a + b - c,
    )


def factorial_ratio(rng: random.Random) -> Problem:
    n = rng.randint(12, 90)
    m = n - rng.choice((2, 3, 4))
    return Problem(
        "factorial_ratio",
        (n, m),
        f"import math\nprint(math.factorial({n}) // math.factorial({m}))",
        f"print(math.factorial({n}) // math.factorial({m}))",
        math.factorial(n) // math.factorial(m),
    )


FAMILIES = {
    "product": product,
    "sum_of_squares": sum_of_squares,
    "modular_power": modular_power,
    "prime_count": prime_count,
    "gcd": gcd,
    "digit_sum": digit_sum,
    "add_subtract": add_subtract,
    "factorial_ratio": factorial_ratio,
}


# How each family is asked: the first wording is the one the cold start uses (and train.jsonl); the GRPO questions
# use all three, so GRPO trains on wordings the cold start never saw. {0}, {1}, {2}: the numbers as asked.
WORDINGS = {
    "product": ("What is {0} * {1}?", "Multiply {0} by {1}.", "Compute the product of {0} and {1}."),
    "sum_of_squares": (
        "What is the sum of the squares of the integers from 1 to {0}?",
        "Add up k^2 for every integer k from 1 to {0}.",
        "Compute 1^2 + 2^2 + ... + {0}^2.",
    ),
    "modular_power": (
        "What is {0}^{1} mod {2}?",
        "Find the remainder when {0}^{1} is divided by {2}.",
        "Compute {0} to the power {1}, modulo {2}.",
    ),
    "prime_count": (
        "How many prime numbers are less than {0}?",
        "Count the primes below {0}.",
        "How many primes p satisfy p < {0}?",
    ),
    "gcd": (
        "What is the greatest common divisor of {0} and {1}?",
        "Find gcd({0}, {1}).",
        "What is the largest integer that divides both {0} and {1}?",
    ),
    "digit_sum": (
        "What is the sum of the digits of 2^{0}?",
        "Add up the decimal digits of 2 to the power {0}.",
        "Compute the digit sum of 2^{0}.",
    ),
    "add_subtract": (
        "What is {0} + {1} - {2}?",
        "Compute {0} plus {1} minus {2}.",
        "Start from {0}, add {1}, then subtract {2}. What do you get?",
    ),
    "factorial_ratio": (
        "What is {0} factorial divided by {1} factorial?",
        "Compute {0}! / {1}!.",
        "What is the value of {0}! divided by {1}!?",
    ),
}
COMMUTATIVE = {"product", "gcd"}  # the order of two factors does not make another question


def _pattern(wording: str) -> re.Pattern:
    return re.compile(re.sub(r"\\\{\d\\\}", lambda _: r"(\d+)", re.escape(wording)))


PATTERNS = [(family, _pattern(w)) for family, wordings in WORDINGS.items() for w in wordings]


def problem_key(family: str, asked: tuple[int, ...]) -> tuple:
    return (family, tuple(sorted(asked)) if family in COMMUTATIVE else asked)


def problem_of_question(text: str) -> tuple | None:
    """The key (family, numbers) of a question in one of the families' wordings; None for another question."""
    for family, pattern in PATTERNS:
        found = pattern.fullmatch(text)
        if found:
            return problem_key(family, tuple(int(n) for n in found.groups()))
    return None


def reworded(problem: Problem, wording: int) -> Problem:
    """The problem asked in its family's `wording`-th way."""
    return dataclasses.replace(problem, question=WORDINGS[problem.family][wording].format(*problem.asked))


def draw(count: int, rng: random.Random, taken: set[tuple]) -> list[Problem]:
    """`count` problems, the families in turn, none with a key in `taken` (which grows)."""
    problems = []
    makers = list(FAMILIES.values())
    tries = 0
    while len(problems) < count:
        problem = makers[len(problems) % len(makers)](rng)
        tries += 1
        if tries > 1000 * count:
            raise RuntimeError(f"cannot draw {count} distinct problems: the {problem.family} family is used up")
        if problem.key in taken:
            continue
        taken.add(problem.key)
        problems.append(problem)
    return problems


def prompt_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def question_rows(problems: list[Problem]) -> list[dict]:
    return [
        {
            "id": f"mtq-{i:03d}",
            "dataset": f"math-tools/{p.family}",
            "messages": prompt_messages(p.question),
            "ground_truth": str(p.answer),
        }
        for i, p in enumerate(problems)
    ]


def call_text(lead: str, code: str) -> str:
    return f"{lead}\n{hermes_block('python', {'code': code})}"


def trajectories(problems: list[Problem], seed: int, tool) -> list[dict]:
    """The cold-start conversations of `problems`, their code run by `tool` (the sandboxed python tool)."""
    rng = random.Random(seed)
    failing = [rng.random() < FAILING_SHARE for _ in problems]
    first = tool.run_many([{"code": p.failing_code if f else p.code} for p, f in zip(problems, failing)])
    fixed = iter(tool.run_many([{"code": p.code} for p, f in zip(problems, failing) if f]))
    rows = []
    for i, (p, fails, result) in enumerate(zip(problems, failing, first)):
        messages = prompt_messages(p.question)
        messages += [
            {"role": "assistant", "content": call_text(rng.choice(CALL_LEADS), p.failing_code if fails else p.code)},
            {"role": "tool", "content": result.text},
        ]
        if fails:
            if result.status == "ok":
                raise RuntimeError(f"{p.question}: the failing code {p.failing_code!r} ran: {result.text!r}")
            error = result.text.strip().splitlines()[-1]
            result = next(fixed)
            lead = rng.choice(FIX_LEADS).format(error=error)
            messages += [
                {"role": "assistant", "content": call_text(lead, p.code)},
                {"role": "tool", "content": result.text},
            ]
        if result.status != "ok" or result.text.strip() != str(p.answer):
            raise RuntimeError(f"{p.question}: the sandbox printed {result.text!r}, expected {p.answer}")
        messages.append({"role": "assistant", "content": rng.choice(ANSWERS).format(answer=p.answer)})
        rows.append(
            {
                "id": f"tc-{i:04d}",
                "dataset": f"math-tools-cold-start/{p.family}",
                "messages": messages,
                "tools": [tool_schema(tool)],
                "ground_truth": str(p.answer),
            }
        )
    return rows


def excluded_keys(paths) -> set[tuple]:
    """The keys of every question in these chat-row files."""
    keys = set()
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                question = [m for m in json.loads(line)["messages"] if m["role"] == "user"][-1]["content"]
                key = problem_of_question(question)
                if key is not None:
                    keys.add(key)
    return keys


def make(questions: int, count: int, seed: int, tool, excluded=EXCLUDED) -> tuple[list[dict], list[dict]]:
    """(question rows, cold-start rows): questions first, then cold-start problems none of them (nor the
    excluded files' questions) asks."""
    rng = random.Random(seed)
    taken = excluded_keys(excluded)
    asked = [reworded(p, rng.randrange(len(WORDINGS[p.family]))) for p in draw(questions, rng, taken)]
    return question_rows(asked), trajectories(draw(count, rng, taken), seed + 1, tool)


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    from refiner_core.agent.tools.python_sandbox import make_python_tool
    from refiner_core.config import AgentConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=160)
    ap.add_argument("--trajectories", type=int, default=320)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    tool = make_python_tool(AgentConfig(tool_concurrency=2))
    try:
        asked, cold = make(args.questions, args.trajectories, args.seed, tool)
    finally:
        tool.close()
    write_jsonl(asked, args.out / "questions.jsonl")
    write_jsonl(cold, args.out / "cold-start.jsonl")
    two_calls = sum(sum(m["role"] == "tool" for m in r["messages"]) == 2 for r in cold)
    print(
        f"{len(asked)} questions -> {args.out / 'questions.jsonl'}; {len(cold)} cold-start conversations "
        f"({two_calls} with an error, then the fix) -> {args.out / 'cold-start.jsonl'}"
    )


if __name__ == "__main__":
    main()
