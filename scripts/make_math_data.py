"""Generate the offline math rows of the GT-GRPO and Co-rewarding recipes (seeded, no network).

Problems come from reasoning-gym's `chain_sum` (sums and differences of small whole numbers); the prompt wording
is this project's own. Three files are written, as open-instruct style chat rows (`id`, `messages`,
`ground_truth`, `dataset`; a system turn asks for the answer in \\boxed{}):

  data/math/train.jsonl  one row per question (GT-GRPO)
  data/math/twins.jsonl  each question twice: as worded in train.jsonl and rephrased in words ("Start from 12,
                         add 7, then take away 5 ..."), the two rows naming each other in `twin_id`
                         (Co-rewarding-I: the pseudo-label of one view is the majority answer of the other's)
  data/math/easy.jsonl   the easiest level alone (two one-digit terms; bench/gt_grpo_math.py)

    .venv/bin/python scripts/make_math_data.py [--questions 240] [--seed 7] [--out data/math]

`--hub knoveleng/open-rs` converts a hub math set (OpenRS; columns --question-column / --answer-column) into
the same chat rows instead, appending a \\boxed{} instruction; twins come from --rephrased-column when the set
has one.

The rephrased twins of the generated set are written by a template. To rephrase with a served LLM instead,
`--rephrase-endpoint http://127.0.0.1:8000/v1 --rephrase-model NAME` asks any OpenAI-compatible server (e.g.
`vllm serve`) for each question's rephrasing. Answers are cached per question under --rephrase-cache, so a rerun
never pays twice; the key is read from OPENAI_API_KEY. An unusable answer (a number lost) falls back to the
template, counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The system turn asks for the answer format, with an example: a 135M model boxes its answer far more often so.
SYSTEM = "Solve the arithmetic problem. End your reply with the result in \\boxed{}, for example \\boxed{12}."
ORIGINAL_TEMPLATES = ("Compute {expr}.", "What is {expr}?", "Evaluate the expression {expr}.")
LEVELS = ((2, 1), (2, 2), (3, 1))  # (terms, digits): mostly easy, so a small model gets some right before training
OPERATION_WORDS = {"+": ("add {n}", "then add {n}", "plus {n}"), "-": ("take away {n}", "subtract {n}", "minus {n}")}
REPHRASE_PROMPT = (
    "Rephrase the following math question so that it asks for exactly the same number in different words. "
    "Keep every number. Keep the instruction about \\boxed{{}}. Reply with the rephrased question only.\n\n"
    "Question: {question}"
)


def chain_sum_problems(count: int, seed: int, levels: tuple = LEVELS) -> list[dict]:
    """Up to `count` distinct problems drawn from the (terms, digits) levels, shuffled (reasoning-gym chain_sum,
    seeded)."""
    import reasoning_gym

    problems, seen = [], set()
    for terms, digits in levels:
        dataset = reasoning_gym.create_dataset(
            "chain_sum",
            size=count * 2,
            seed=seed + 31 * terms + digits,
            min_terms=terms,
            max_terms=terms,
            min_digits=1,
            max_digits=digits,
        )
        for item in dataset:
            expr = item["metadata"]["expression"]
            if expr not in seen:
                seen.add(expr)
                problems.append({"expression": expr, "answer": str(item["answer"]), "terms": terms, "digits": digits})
    random.Random(seed).shuffle(problems)
    return problems[:count]


def verbal_rephrasing(expression: str, rng: random.Random) -> str:
    """'12 + 7 - 5' -> 'Start from 12, add 7, then take away 5. What number do you end up with? ...'"""
    tokens = expression.split()
    steps = [rng.choice(OPERATION_WORDS[op]).format(n=n) for op, n in zip(tokens[1::2], tokens[2::2])]
    return f"Start from {tokens[0]}, {', '.join(steps)}. What number do you end up with?"


def served_rephrasing(question: str, endpoint: str, model: str, cache_dir: Path, timeout: float) -> str | None:
    """One rephrasing from an OpenAI-compatible server, cached on disk by (model, question)."""
    import httpx

    from refiner_core.runtime.http_chat import ChatError, chat_with_retries

    key = hashlib.blake2b(json.dumps([model, question]).encode(), digest_size=12).hexdigest()
    cached = cache_dir / f"{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())["text"]
    body = {
        "model": model,
        "temperature": 0.0,
        "max_tokens": 256,
        "messages": [{"role": "user", "content": REPHRASE_PROMPT.format(question=question)}],
    }
    try:
        with httpx.Client() as client:
            text, _ = chat_with_retries(
                client, endpoint, body, api_key=os.environ.get("OPENAI_API_KEY", ""), timeout_seconds=timeout
            )
    except ChatError as e:  # not cached: the next run asks again
        print(f"rephrasing failed ({e}); using the template for this question", file=sys.stderr)
        return None
    text = text.strip()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps({"question": question, "text": text}))
    tmp.replace(cached)
    return text


def usable_rephrasing(text: str | None, expression: str) -> bool:
    """Every number of the expression still appears, as a whole number ('15 plus 15' does not hold 5)."""
    numbers = set(re.findall(r"(?<![\d.])\d+(?:\.\d+)?(?!\.?\d)", text or ""))
    return bool(text) and all(n in numbers for n in expression.split()[::2])


def hub_problems(name: str, split: str, question_column: str, answer_column: str, rephrased_column: str) -> list[dict]:
    """Problems of a hub math set (e.g. OpenRS, knoveleng/open-rs: columns problem, answer); needs network."""
    import datasets

    rows = datasets.load_dataset(name, split=split)
    missing = [c for c in (question_column, answer_column, rephrased_column) if c and c not in rows.column_names]
    if missing:
        raise SystemExit(f"{name}: no column {missing}; its columns: {rows.column_names}")
    return [
        {
            "question": f"{r[question_column].strip()}\n\nPut your final answer within \\boxed{{}}.",
            "answer": str(r[answer_column]).strip(),
            "rephrased": (
                f"{r[rephrased_column].strip()}\n\nPut your final answer within \\boxed{{}}."
                if rephrased_column and r[rephrased_column]
                else None
            ),
        }
        for r in rows
    ]


def build_rows(problems: list[dict], seed: int, rephrase=None) -> tuple[list[dict], list[dict], int]:
    """(train rows, twin rows, rephrasings that fell back to the template). Generated problems carry an
    `expression`; hub problems a `question` (and maybe a `rephrased` one)."""
    rng = random.Random(seed + 1)
    train, twins, fallbacks = [], [], 0
    for i, p in enumerate(problems):
        qid = f"math-{i:04d}"
        if "question" in p:  # a hub problem: its twin is its rephrased column, else the endpoint's, else none
            question = p["question"]
            twin_text = p["rephrased"] or (rephrase(question) if rephrase else None)
        else:
            question = rng.choice(ORIGINAL_TEMPLATES).format(expr=p["expression"])
            twin_text = rephrase(question) if rephrase else None
            if not usable_rephrasing(twin_text, p["expression"]):
                fallbacks += rephrase is not None
                twin_text = verbal_rephrasing(p["expression"], rng)
        system = [] if "question" in p else [{"role": "system", "content": SYSTEM}]
        row = {
            "id": qid,
            "messages": [*system, {"role": "user", "content": question}],
            "ground_truth": p["answer"],
            "dataset": p.get("dataset", "reasoning_gym/chain_sum"),
        }
        train.append(row)
        if not twin_text:
            continue
        twins.append({**row, "twin_id": f"{qid}-r"})
        twins.append(
            {**row, "id": f"{qid}-r", "messages": [*system, {"role": "user", "content": twin_text}], "twin_id": qid}
        )
    return train, twins, fallbacks


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=240)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=REPO / "data" / "math")
    ap.add_argument("--hub", default="", help="convert this hub math set instead of generating (needs network)")
    ap.add_argument("--hub-split", default="train")
    ap.add_argument("--question-column", default="problem")
    ap.add_argument("--answer-column", default="answer")
    ap.add_argument("--rephrased-column", default="", help="hub column holding each problem's rephrasing")
    ap.add_argument("--rephrase-endpoint", default="", help="OpenAI-compatible base URL (…/v1); '' = template twins")
    ap.add_argument("--rephrase-model", default="")
    ap.add_argument("--rephrase-cache", type=Path, default=Path.home() / ".cache" / "refiner-grpo" / "rephrase")
    ap.add_argument("--rephrase-timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    rephrase = None
    if args.rephrase_endpoint:

        def rephrase(question: str) -> str:
            return served_rephrasing(
                question, args.rephrase_endpoint, args.rephrase_model, args.rephrase_cache, args.rephrase_timeout
            )

    if args.hub:
        problems = [
            {**p, "dataset": args.hub}
            for p in hub_problems(
                args.hub, args.hub_split, args.question_column, args.answer_column, args.rephrased_column
            )
        ]
    else:
        problems = chain_sum_problems(args.questions, args.seed)
    train, twins, fallbacks = build_rows(problems, args.seed, rephrase)
    write_jsonl(train, args.out / "train.jsonl")
    if twins:
        write_jsonl(twins, args.out / "twins.jsonl")
    if not args.hub:  # the easiest level alone: what the GT-GRPO demonstration trains SmolLM2-135M on
        easy, _, _ = build_rows(chain_sum_problems(args.questions, args.seed + 1, ((2, 1),)), args.seed + 1)
        write_jsonl([{**r, "id": r["id"].replace("math-", "easy-")} for r in easy], args.out / "easy.jsonl")
        print(f"{len(easy)} easy questions (two one-digit terms) -> {args.out / 'easy.jsonl'}")
    print(
        f"{len(train)} questions -> {args.out / 'train.jsonl'}; {len(twins)} rows (both views) -> "
        f"{args.out / 'twins.jsonl'}" + (f"; {fallbacks} rephrasings fell back to the template" if rephrase else "")
    )


if __name__ == "__main__":
    main()
