"""A rollout samples its groups in parts, each written as it is done: an attempt killed after some parts samples only
the others, with the same samples as an attempt that never stopped (each part seeded by its place in the step); one
part of the whole step samples exactly what the engine samples for the step in one call."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from refiner_core.config import EngineSettings
from refiner_core.rollout.base import SamplingParams, make_engine, part_ranges
from refiner_core.schema import ROLLOUTS
from tasks.rollout import parts_folder, sample_in_parts
from tasks.sampling import response_columns


class Counting:
    """An engine that counts its generate calls, and can die after `die_after` of them (a killed attempt)."""

    def __init__(self, engine, die_after: int | None = None):
        self.engine, self.die_after, self.calls = engine, die_after, []

    def generate(self, prompts, params, desc=""):
        if self.die_after is not None and len(self.calls) == self.die_after:
            raise RuntimeError("killed")
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, params, desc)


def _to_rows(outputs):
    return [
        {c: None for c in ROLLOUTS.column_names}
        | {"run": "t", "step": 0, "prompt_id": f"p{p}", "sample_idx": s, **response}
        for p, s, response in outputs
    ]


def _sampled(rows):
    return [(r["prompt_id"], r["sample_idx"], r["response_token_ids"], r["response_logprobs"]) for r in rows]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return make_engine(str(tiny_model_path), EngineSettings.of(engine="hf", batch_size=4))


PROMPTS = [[1, 2, 3, 4 + p] + [5] * p for p in range(5)]  # five prompts of different lengths
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1234)


def _sample(engine, folder, per_part=2):
    return sample_in_parts(
        engine,
        PROMPTS,
        PARAMS,
        per_part=per_part,
        folder=folder,
        to_rows=_to_rows,
        step=0,
        markers=folder.parent / ".faults",
        log=logging.getLogger("test"),
    )


def test_part_ranges():
    assert part_ranges(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert part_ranges(4, 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert part_ranges(3, 8) == [(0, 3)]


def test_a_killed_rollout_samples_only_the_missing_parts_and_the_same_samples(engine, tmp_path, caplog):
    whole = _sample(Counting(engine), tmp_path / "uninterrupted" / ".parts-a")
    killed = tmp_path / "killed" / ".parts-a"
    with pytest.raises(RuntimeError, match="killed"):
        _sample(Counting(engine, die_after=2), killed)
    assert sorted(p.name for p in killed.iterdir()) == ["part-0000-0002.parquet", "part-0002-0004.parquet"]
    resumed = Counting(engine)
    with caplog.at_level(logging.INFO, logger="test"):
        rows = _sample(resumed, killed)
    assert resumed.calls == [1]  # only the last part (one prompt) was sampled again
    assert _sampled(rows) == _sampled(whole)
    assert "2 of 3 parts (4 of 5 groups) were written by an earlier attempt" in caplog.text


def test_a_rollout_resumed_with_another_part_size_reads_no_part_of_other_prompts(engine, tmp_path):
    """Killed after two parts of 2 prompts, resumed with 1 prompt per part (rollout.groups_per_part lowered after an
    out-of-memory, say): no part written covers a range of the new attempt, so every group is sampled, once."""
    whole = _sample(Counting(engine), tmp_path / "uninterrupted" / ".parts-a", per_part=1)
    killed = tmp_path / "killed" / ".parts-a"
    with pytest.raises(RuntimeError, match="killed"):
        _sample(Counting(engine, die_after=2), killed, per_part=2)
    resumed = Counting(engine)
    rows = _sample(resumed, killed, per_part=1)
    assert resumed.calls == [1] * len(PROMPTS)
    assert _sampled(rows) == _sampled(whole)


def test_one_part_samples_what_the_engine_samples_for_the_whole_step(engine, tmp_path):
    rows = _sample(engine, tmp_path / ".parts-a", per_part=len(PROMPTS))
    direct = _to_rows([(g.prompt_index, g.sample_idx, response_columns(g)) for g in engine.generate(PROMPTS, PARAMS)])
    assert _sampled(rows) == _sampled(direct)
    shifted = engine.generate(PROMPTS[2:], replace(PARAMS, prompt_offset=2))  # a part is seeded by its place
    assert [g.token_ids for g in shifted] != [g.token_ids for g in engine.generate(PROMPTS[2:], PARAMS)]


def test_parts_of_other_inputs_are_never_reused(tmp_path):
    mine = parts_folder(tmp_path, ["policy-a", "prompts"])
    mine.mkdir()
    other = parts_folder(tmp_path, ["policy-b", "prompts"])  # another policy: another folder; the first one goes
    assert other != mine and not mine.exists()


def test_no_batch_shares_its_random_stream_with_another_steps_batch(engine):
    """Step seeds are consecutive (seed * 100_003 + step): a later batch of step s seeded s + its place would be step
    s + place's first batch, the same draws for the same prompts. Batches after the first take a mixed seed."""
    same = [[1, 2, 3, 4]] * 4  # n=2, batch_size 4: prompts 0-1 are the first batch, 2-3 the second (place 4)
    step = engine.generate(same, PARAMS)
    later_step = engine.generate(same, replace(PARAMS, seed=PARAMS.seed + 4))
    second_batch = [g.token_ids for g in step if g.prompt_index >= 2]
    assert second_batch != [g.token_ids for g in later_step if g.prompt_index < 2]
    # the first batch keeps the step's seed: the same draws whatever follows it
    assert [g.token_ids for g in engine.generate(same[:2], PARAMS)] == [g.token_ids for g in step if g.prompt_index < 2]


@pytest.mark.slow
def test_parts_of_a_killed_attempt_under_another_run_name_are_not_reused(api_env, tmp_path):
    """A rollout killed after its first part, run again in the same folder under another run.name: every row names
    the run that wrote rollouts.parquet (the parts' rows hold the run's name)."""
    from conftest import REPO, catalog_rows, run_cli

    folder = tmp_path / "run"
    base = ["run", str(REPO / "recipes" / "tiny.yaml"), "--set", "grpo.steps=1", "--set", "rollout.groups_per_part=1"]
    base += ["--set", "eval.every=0", "--run-dir", str(folder)]
    killed = {**api_env, "REFINER_KILL_ONCE": "rollout@0:part1"}
    code, _, err, _ = run_cli([*base, "--set", "run.name=first"], tmp_path, killed)
    assert code == 137, err[-3000:]
    code, _, err, _ = run_cli([*base, "--set", "run.name=second"], tmp_path, api_env)
    assert code == 0, err[-3000:]
    assert catalog_rows(folder, "SELECT DISTINCT run FROM rollouts") == [("second",)]


@pytest.mark.slow
def test_parts_sampled_from_prompts_since_edited_are_not_reused(api_env, tmp_path):
    """A rollout killed after its first part; the data file's questions are edited (the same row IDs, so the same
    prompt IDs) before the rerun: every row holds the new prompts' tokens (the part sampled from the old text was
    kept: prompt_token_ids of the old question)."""
    import json

    from conftest import REPO, catalog_rows, run_cli

    data = tmp_path / "rows.jsonl"
    data.write_text((REPO / "data" / "refiner" / "samples.jsonl").read_text())
    folder = tmp_path / "run"
    base = ["run", str(REPO / "recipes" / "tiny.yaml"), "--set", "grpo.steps=1", "--set", "rollout.groups_per_part=1"]
    base += ["--set", "eval.every=0", "--set", f"data.path={data}", "--run-dir", str(folder)]
    code, _, err, _ = run_cli(base, tmp_path, {**api_env, "REFINER_KILL_ONCE": "rollout@0:part1"})
    assert code == 137, err[-3000:]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps({**r, "question": "Briefly: " + r["question"]}) + "\n" for r in rows))
    code, _, err, _ = run_cli(base, tmp_path, api_env)
    assert code == 0, err[-3000:]
    stale = catalog_rows(
        folder,
        "SELECT count(*) FROM rollouts r JOIN prompts p USING (run, prompt_id) "
        "WHERE r.prompt_token_ids <> p.prompt_token_ids",
    )
    assert stale == [(0,)]
