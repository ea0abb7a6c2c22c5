"""The train/validation split is drawn per prompt, not per row (prepare-data and prepare-sft alike), and the SFT warm
start leaves out every row of a held-out prompt: by its prompt whatever the answer, by its ID only when SFT reads
the prompts' own source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refiner_core.config import DataConfig, SFTConfig, load_recipe
from refiner_core.data.prepare import prepare_prompts
from refiner_core.data.rows import RawRow, parse_jsonl_line, prompt_hash, split_of, validate_rows
from refiner_core.data.sources import load_rows, source_identity
from refiner_core.sft.data import SFTLimits, normalise_tool_rows, prepare_sft, stats_rows

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data" / "refiner" / "samples.jsonl"
LIMITS = SFTLimits(
    max_prompt_tokens=100_000, max_response_tokens=100_000, max_total_tokens=100_000, pack_length=100_000
)


def _samples() -> list[dict]:
    return [json.loads(line) for line in SAMPLES.read_text().splitlines()]


def _validated(rows: list[dict]) -> list[dict]:
    checked = validate_rows([parse_jsonl_line(n, json.dumps(r).encode()) for n, r in enumerate(rows, 1)])
    assert checked.rejected == []
    return checked.rows


def _held_out(prompts: list[dict], rows: list[dict]) -> list[dict]:
    """The validation prompts as prepare-sft receives them: prompt rows plus their prompt_hash."""
    hash_of = {r["id"]: prompt_hash(r) for r in rows}
    return [{**p, "prompt_hash": hash_of[p["prompt_id"]]} for p in prompts if p["split"] == "validation"]


def _one_prompt_many_answers(shape: str) -> list[dict]:
    """40 rows asking one thing with 40 different answers, then 20 rows with prompts of their own."""
    if shape == "refiner":
        base, others = _samples()[0], _samples()[1:21]
        variants = [
            dict(base, id=f"dup-{i:02d}", answer=base["answer"].replace("</answer>", f" (variant {i})</answer>"))
            for i in range(40)
        ]
        return variants + others

    def chat(rid: str, question: str, answer: str) -> dict:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return {"id": rid, "messages": messages}

    variants = [chat(f"dup-{i:02d}", "What is 6 * 7?", f"It is 42 (variant {i}).") for i in range(40)]
    return variants + [chat(f"own-{i:02d}", f"What is {i} + {i}?", str(2 * i)) for i in range(20)]


@pytest.mark.parametrize("shape", ["refiner", "chat"])
def test_one_prompt_with_many_answers_lands_in_one_split_and_sft_keeps_none_of_it(tiny_tokenizer, shape):
    rows = _validated(_one_prompt_many_answers(shape))
    variant_ids = [r["id"] for r in rows if r["id"].startswith("dup-")]
    seed = next(s for s in range(100) if split_of("dup-00", 0.2, s) == "validation")
    assert {split_of(i, 0.2, seed) for i in variant_ids} == {"train", "validation"}  # what a per-row split did
    prompts, rejected = prepare_prompts(rows, tiny_tokenizer, "t", 100_000, 100_000, 0.2, seed)
    assert rejected == []
    splits = {p["prompt_id"]: p["split"] for p in prompts}
    assert {splits[i] for i in variant_ids} == {"validation"}  # the split of the group's smallest ID
    others = [r["id"] for r in rows if r["id"] not in variant_ids]
    assert all(splits[i] == split_of(i, 0.2, seed) for i in others)  # prompts of their own keep theirs
    held_out = _held_out(prompts, rows)

    out = prepare_sft(rows, tiny_tokenizer, "t", LIMITS, 0.0, 0, held_out=held_out)
    assert not [e for e in out.examples if e["source_id"] in variant_ids]
    assert {e["source_id"] for e in out.examples} == {i for i in others if splits[i] == "train"}
    assert out.stats["held_out_rows"] == len(held_out) == out.stats["held_out"]["prompt"]


def test_sft_splits_its_examples_by_prompt(tiny_tokenizer):
    """Eight answers to each of six prompts: each prompt's examples share the split of its smallest row ID."""
    base = _samples()[:6]
    rows = _validated(
        [
            dict(row, id=f"{k}-{i}", answer=row["answer"].replace("</answer>", f" (variant {i})</answer>"))
            for k, row in enumerate(base)
            for i in range(8)
        ]
    )
    out = prepare_sft(rows, tiny_tokenizer, "t", LIMITS, 0.3, seed=1)
    assert len(out.examples) == len(rows)
    by_prompt: dict[str, set[str]] = {}
    for e in out.examples:
        by_prompt.setdefault(e["source_id"].split("-")[0], set()).add(e["split"])
    assert all(len(splits) == 1 for splits in by_prompt.values()), by_prompt
    assert {s for splits in by_prompt.values() for s in splits} == {"train", "validation"}
    lead = {e["source_id"]: e["example_id"] for e in out.examples if e["source_id"].endswith("-0")}
    assert by_prompt == {k: {split_of(lead[f"{k}-0"], 0.3, 1)} for k in by_prompt}


def test_twins_and_rows_sharing_a_prompt_form_one_group(tiny_tokenizer):
    def row(rid: str, question: str, truth: str, twin: str | None) -> dict:
        return {"id": rid, "messages": [{"role": "user", "content": question}], "ground_truth": truth, "twin_id": twin}

    rows = _validated(
        [
            row("b", "one plus nothing?", "1", "b-r"),
            row("b-r", "one, rephrased?", "1", "b"),
            row("a", "one, rephrased?", "one", None),  # the twin's prompt, another answer
        ]
    )
    for seed in range(8):
        prompts, _ = prepare_prompts(rows, tiny_tokenizer, "t", 512, 64, 0.5, seed)
        assert {p["split"] for p in prompts} == {split_of("a", 0.5, seed)}


def _old_split(row: dict, fraction: float, seed: int) -> str:
    """The split before it was drawn per prompt: the row's own ID, or for a twin the smaller of the pair's."""
    twin = row.get("twin_id")
    return split_of(min(row["id"], str(twin)) if twin not in (None, "") else row["id"], fraction, seed)


def _recipe_sources() -> dict[Path, tuple[float, int]]:
    """The data files the recipes read, each with its recipe's validation fraction and seed."""
    sources = {}
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        cfg = load_recipe(recipe)
        if (REPO / cfg.data.path).is_file():
            sources.setdefault(REPO / cfg.data.path, (cfg.data.validation_fraction or 0.2, cfg.run.seed))
    return sources


def test_the_shipped_data_splits_as_it_did_per_row(tiny_tokenizer):
    """Their prompts are all distinct: drawing the split per prompt changes none of it."""
    sources = _recipe_sources()
    assert {p.relative_to(REPO).as_posix() for p in sources} >= {
        "data/refiner/samples.jsonl",
        "data/math/twins.jsonl",
        "data/math/train.jsonl",
        "data/math-tools/questions.jsonl",
        "data/chat/mixed.jsonl",
    }
    for path, (fraction, seed) in sources.items():
        rows = validate_rows(load_rows(str(path))).rows
        prompts, _ = prepare_prompts(rows, tiny_tokenizer, "t", 100_000, 100_000, fraction, seed)
        assert len(prompts) == len(rows), path
        by_id = {r["id"]: r for r in rows}
        assert [p["split"] for p in prompts] == [_old_split(by_id[p["prompt_id"]], fraction, seed) for p in prompts]
        assert {p["split"] for p in prompts} == {"train", "validation"}, path


@pytest.mark.parametrize("name", ["refiner/samples.jsonl", "math-tools/cold-start.jsonl"])
def test_the_shipped_sft_data_splits_as_it_did_per_example(tiny_tokenizer, name):
    """Per example, a seeded hash of its conversation (example_id); at least one in validation."""
    usable, _ = normalise_tool_rows(load_rows(str(REPO / "data" / name)))
    rows = validate_rows(usable).rows
    out = prepare_sft(rows, tiny_tokenizer, "t", LIMITS, 0.1, 42)
    assert len(out.examples) == len(rows) - out.stats["skipped_no_answer"] > 0
    old = [split_of(e["example_id"], 0.1, 42) for e in out.examples]
    assert "validation" in old  # so the old rule's fallback (one forced into validation) did not apply
    assert [e["split"] for e in out.examples] == old


def _chat(rid: int, question: str, answer: str | None = None) -> RawRow:
    messages = [{"role": "user", "content": question}] + ([{"role": "assistant", "content": answer}] if answer else [])
    row = {"id": rid, "messages": messages, **({} if answer else {"ground_truth": str(rid)})}
    return parse_jsonl_line(rid + 1, json.dumps(row).encode())


def test_held_out_ids_count_only_for_rows_of_the_prompts_own_source(tiny_tokenizer):
    """Two files that both number their rows 0..19: another file's row 6 is not held-out prompt 6."""
    grpo = validate_rows([_chat(i, f"GRPO question number {i}: what is {i}+{i}?") for i in range(20)]).rows
    prompts, _ = prepare_prompts(grpo, tiny_tokenizer, "t", 10_000, 10_000, 0.3, seed=1)
    held_out = _held_out(prompts, grpo)
    assert held_out
    sft = validate_rows([_chat(i, f"Unrelated SFT instruction {i}: say hello", f"hello {i}") for i in range(20)]).rows
    elsewhere = prepare_sft(sft, tiny_tokenizer, "t", LIMITS, 0.0, 0, held_out=held_out, same_source=False)
    assert len(elsewhere.examples) == 20 and elsewhere.stats["held_out_rows"] == 0
    # The prompts' own rows, answered: by ID and by prompt they are the held-out ones.
    answered = validate_rows([_chat(i, f"GRPO question number {i}: what is {i}+{i}?", str(2 * i)) for i in range(20)])
    same = prepare_sft(answered.rows, tiny_tokenizer, "t", LIMITS, 0.0, 0, held_out=held_out, same_source=True)
    assert len(same.examples) == 20 - len(held_out)
    assert same.stats["held_out"] == {"prompt_id": len(held_out), "prompt": 0, "question": 0}
    counts = {r["name"]: r["value"] for r in stats_rows("t", same.stats) if r["kind"] == "count"}
    assert counts["held_out_rows"] == counts["held_out_by_prompt_id"] == len(held_out)
    by_prompt = prepare_sft(answered.rows, tiny_tokenizer, "t", LIMITS, 0.0, 0, held_out=held_out)
    assert by_prompt.stats["held_out"]["prompt"] == len(held_out)


def test_the_same_source_is_the_same_file_split_and_id_column():
    data = DataConfig(path="data/refiner/samples.jsonl")
    assert source_identity("/d/rows.jsonl", data) == source_identity("/d/rows.jsonl", SFTConfig())
    assert source_identity("/d/rows.jsonl", data) != source_identity("/d/sft.jsonl", SFTConfig())
    assert source_identity("/d/rows.jsonl", data) != source_identity("/d/rows.jsonl", SFTConfig(fields={"id": "key"}))
    assert source_identity("/d/rows", data) != source_identity("/d/rows", SFTConfig(split="sft"))


def test_conversations_that_continue_one_opening_share_the_sft_split(tiny_tokenizer):
    """A two-turn conversation holds a one-turn one's answer as a trained turn: were the short one validated and the
    long one trained, the warm start would imitate the validated answer. Both follow the opening's split."""

    def chat(rid: str, turns: list[tuple[str, str]]) -> dict:
        messages = [m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
        return {"id": rid, "messages": messages}

    rows = []
    for k in range(12):
        first = (f"Question {k}: what is {k} + {k}?", f"{2 * k}.")
        rows += [chat(f"{k}-a", [first]), chat(f"{k}-b", [first, ("And doubled?", f"{4 * k}.")])]
    rows = _validated(rows)
    for seed in range(6):
        out = prepare_sft(rows, tiny_tokenizer, "t", LIMITS, 0.5, seed)
        by_opening: dict[str, set[str]] = {}
        for e in out.examples:
            by_opening.setdefault(e["source_id"].split("-")[0], set()).add(e["split"])
        assert all(len(splits) == 1 for splits in by_opening.values()), (seed, by_opening)
        assert {s for splits in by_opening.values() for s in splits} == {"train", "validation"}
