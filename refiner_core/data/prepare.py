"""From validated rows to the prompts table: prompt fields, rendering within the token limits, the train/validation
split (by prompt), dropping a co-rewarding twin whose partner was dropped, and the data.max_prompts cap."""

from __future__ import annotations

from collections import Counter

from refiner_core.data.formats import tool_snippet_ids
from refiner_core.data.prompts import render_prompt
from refiner_core.data.rows import (
    Rejection,
    ground_truth_text,
    is_chat_row,
    prompt_hash,
    prompt_messages,
    row_json,
    split_of,
)


def prompt_fields(row: dict) -> dict:
    """The prompt-side view of either row shape: chat messages up to the answer plus refiner fields."""
    prompt = prompt_messages(row)
    if not is_chat_row(row):
        return {
            "messages": prompt,
            "question": row["question"],
            "reasoning": row["reasoning"],
            "tool_output": row["tool_output"],
            "answer": row.get("answer") or "",
            "supporting_ids": row.get("supporting_ids"),
            "ground_truth": None,
            "twin_id": None,
        }
    messages = row["messages"]
    ends_with_answer = messages[-1]["role"] == "assistant"
    truth = ground_truth_text(row.get("ground_truth"))
    answer = truth if truth is not None else (messages[-1]["content"] if ends_with_answer else "")
    twin = row.get("twin_id")
    return {
        "messages": prompt,
        "question": [m for m in prompt if m["role"] == "user"][-1]["content"],
        "reasoning": "",
        "tool_output": "\n".join(m["content"] for m in prompt if m["role"] == "tool"),
        "answer": answer,
        "supporting_ids": None,
        "ground_truth": truth,
        "twin_id": str(twin) if twin not in (None, "") else None,
    }


def prepare_prompts(
    rows: list[dict],
    tokenizer,
    run: str,
    max_prompt_tokens: int,
    max_reference_tokens: int,
    validation_fraction: float,
    seed: int,
    context: int | None = None,
) -> tuple[list[dict], list[Rejection]]:
    """Render chat prompts and drop rows over the token limits (each drop is a counted, recorded rejection).
    `context`: the policy's context length; a prompt that fills it leaves no room for a response (vLLM refuses it
    mid-run)."""
    prompts, rejected = [], []
    chars_per_token = max_chars_per_token(tokenizer)
    split_ids = split_leads(rows)
    for row in rows:
        view = prompt_fields(row)
        answer = view["answer"]
        raw = row_json(row)
        # A row far over a limit is rejected before tokenizing it: a multi-megabyte row would take seconds and
        # gigabytes to tokenize only to be dropped.
        prompt_chars = sum(kept_chars(m["content"]) for m in view["messages"])
        if prompt_chars > max_prompt_tokens * chars_per_token:
            rejected.append(
                Rejection(
                    row["row_ref"],
                    "prompt_too_long",
                    f"{prompt_chars} characters besides "
                    f"whitespace: more than max_prompt_tokens {max_prompt_tokens} tokens can hold",
                    raw,
                )
            )
            continue
        if kept_chars(answer) > max_reference_tokens * chars_per_token:
            rejected.append(
                Rejection(
                    row["row_ref"],
                    "reference_too_long",
                    f"{kept_chars(answer)} answer "
                    f"characters besides whitespace: more than max_reference_tokens "
                    f"{max_reference_tokens} tokens can hold",
                    raw,
                )
            )
            continue
        text, ids = render_prompt(tokenizer, view["messages"])
        ref_tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"]) if answer else 0
        if len(ids) > max_prompt_tokens:
            rejected.append(
                Rejection(
                    row["row_ref"],
                    "prompt_too_long",
                    f"{len(ids)} prompt tokens > max_prompt_tokens {max_prompt_tokens}",
                    raw,
                )
            )
            continue
        if context is not None and len(ids) >= context:
            rejected.append(
                Rejection(
                    row["row_ref"],
                    "prompt_too_long",
                    f"{len(ids)} prompt tokens leave no room for a response in the policy's context of {context} "
                    "tokens",
                    raw,
                )
            )
            continue
        if ref_tokens > max_reference_tokens:
            rejected.append(
                Rejection(
                    row["row_ref"],
                    "reference_too_long",
                    f"{ref_tokens} answer tokens > max_reference_tokens {max_reference_tokens}",
                    raw,
                )
            )
            continue
        prompts.append(
            {
                "run": run,
                "prompt_id": row["id"],
                "split": split_of(split_ids[row["id"]], validation_fraction, seed),
                "question": view["question"],
                "reasoning": view["reasoning"],
                "tool_output": view["tool_output"],
                "snippet_ids": tool_snippet_ids(view["tool_output"]),
                "supporting_ids": view["supporting_ids"],
                "reference_answer": answer,
                "ground_truth": view["ground_truth"],
                "twin_id": view["twin_id"],
                "prompt_text": text,
                "prompt_token_ids": ids,
                "prompt_tokens": len(ids),
                "reference_tokens": ref_tokens,
                "content_hash": row["content_hash"],
            }
        )
    return drop_unpaired_twins(prompts, rows, rejected)


def split_leads(rows: list[dict]) -> dict[str, str]:
    """For each row ID, the ID its split is drawn from (split_of). A row's own lead is its ID, or for one of a
    twin pair the smaller ID of the two (both views share a split). Rows that share a prompt, with any answers,
    and the twins that name each other form a group, and the group takes the smallest lead among them: no prompt
    is in both splits, and rows with distinct prompts keep their own lead."""
    twin_of = {r["id"]: prompt_fields(r)["twin_id"] for r in rows}
    parent = {i: i for i in twin_of}  # union-find over row IDs: one root per group

    def root(i: str) -> str:
        while parent[i] != i:
            parent[i] = i = parent[parent[i]]  # path halving: long groups stay cheap
        return i

    def join(a: str, b: str) -> None:
        a, b = root(a), root(b)
        parent[max(a, b)] = min(a, b)

    first_asking: dict[str, str] = {}
    for r in rows:
        join(r["id"], first_asking.setdefault(prompt_hash(r), r["id"]))
        twin = twin_of[r["id"]]
        if twin in twin_of and twin_of[twin] == r["id"]:
            join(r["id"], twin)
    lead: dict[str, str] = {}
    for i, twin in twin_of.items():
        own = min(i, twin) if twin else i
        lead[root(i)] = min(lead.get(root(i), own), own)
    return {i: lead[root(i)] for i in twin_of}


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: the length of the longest vocabulary entry (a byte-level
    token spells one character per byte, a SentencePiece piece one per character, byte-fallback tokens like
    '<0x41>' stand for fewer than they spell). Text with more than N times this many characters needs more than
    N tokens."""
    return max(map(len, tokenizer.get_vocab()))


def kept_chars(text: str) -> int:
    """Characters of `text` that no tokenizer drops: whitespace does not count, as some tokenizers collapse it."""
    return len(text) - sum(text.count(c) for c in " \t\n\r")


def drop_unpaired_twins(
    prompts: list[dict], rows: list[dict], rejected: list[Rejection]
) -> tuple[list[dict], list[Rejection]]:
    """A prompt naming a twin (`twin_id`, its rephrased view) is kept only when that twin was prepared and names
    it back: a view without its partner could never get a pseudo-label. The others are rejected as 'unknown_twin'."""
    by_id = {p["prompt_id"]: p for p in prompts}
    broken = {
        p["prompt_id"]
        for p in prompts
        if p["twin_id"] is not None
        and (p["twin_id"] == p["prompt_id"] or by_id.get(p["twin_id"], {}).get("twin_id") != p["prompt_id"])
    }
    if not broken:
        return prompts, rejected
    raw_of = {r["id"]: r for r in rows}
    for pid in sorted(broken):
        row = raw_of[pid]
        twin = by_id[pid]["twin_id"]
        why = (
            "names itself"
            if twin == pid
            else f"{twin!r} is not a prepared prompt"
            if twin not in by_id
            else f"{twin!r} names {by_id[twin]['twin_id']!r} as its twin"
        )
        rejected.append(
            Rejection(
                row["row_ref"],
                "unknown_twin",
                f"twin_id {why}",
                row_json(row),
            )
        )
    return [p for p in prompts if p["prompt_id"] not in broken], rejected


def cap_prompts(prompts: list[dict], max_prompts: int) -> list[dict]:
    """The first prompts, at most `max_prompts` (0: all), a twin pair taken or left whole: a view without its twin
    could never get a pseudo-label. Run after drop_unpaired_twins, so every twin named is there."""
    if not max_prompts:
        return prompts
    kept: set[str] = set()
    for p in prompts:
        if p["prompt_id"] in kept:
            continue
        unit = {p["prompt_id"], p.get("twin_id")} - {None}
        if len(kept) + len(unit) > max_prompts:
            break
        kept |= unit
    return [p for p in prompts if p["prompt_id"] in kept]


def no_training_prompts(
    prompts: list[dict], rejected: list[Rejection], validation_fraction: float, max_prompts: int
) -> str:
    """Why prepare-data left no prompt in the training split, the only one GRPO samples from, and what to change."""
    kept = f" (data.max_prompts {max_prompts} keeps the first)" if max_prompts else ""
    why = (
        f"all {len(prompts)} prepared prompts{kept} are in the validation split (data.validation_fraction "
        f"{validation_fraction})"
        if prompts
        else f"no prompt was prepared{kept}"
    )
    return (
        f"no training prompt: {why}; rows rejected: {reason_counts(rejected)}. Lower data.validation_fraction, "
        "raise data.max_prompts (0 = all), or fix the rejected rows"
    )


def rubrics_left_no_training_prompt(n_train: int, rejected: list[Rejection]) -> str:
    """Why the rubric stage left no training prompt (it rejected every one), and what to change."""
    return (
        f"no training prompt: ingest-rubrics rejected each of the {n_train} training prompts (rejections: "
        f"{reason_counts(rejected)}). Give them rubrics (or a ground_truth, or set rubrics.generation_endpoint), "
        "lower data.validation_fraction, or raise data.max_prompts (0 = all)"
    )


def reason_counts(rejected: list[Rejection]) -> str:
    """'invalid_json 2, non_utf8 1', or 'none'."""
    return ", ".join(f"{reason} {n}" for reason, n in sorted(Counter(r.reason for r in rejected).items())) or "none"
