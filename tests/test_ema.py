"""The EMA teacher of Co-rewarding-II: alpha schedule, EMA weights, and the recipe end to end with a kill."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_ON_CPU, catalog_rows, run_cli
from refiner_core.algo.ema import alpha_at, ema_checkpoint, is_update_step
from refiner_core.reward.pseudo_labels import majority_vote, vote_of

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 0.5),
        (1, 0.1 + 0.4 * (1 + math.cos(math.pi / 4)) / 2),  # 0.441421...
        (2, 0.3),  # halfway: the mean of start and end
        (3, 0.1 + 0.4 * (1 + math.cos(3 * math.pi / 4)) / 2),  # 0.158578...
        (4, 0.1),
        (9, 0.1),  # after the schedule: alpha_end
    ],
)
def test_alpha_follows_a_cosine_from_start_to_end(step, expected):
    assert alpha_at(step, 0.5, 0.1, 4) == pytest.approx(expected, abs=1e-12)


def test_alpha_with_the_published_range_and_update_steps():
    assert alpha_at(0, 0.01, 1e-5, 100) == pytest.approx(0.01)
    assert alpha_at(50, 0.01, 1e-5, 100) == pytest.approx((0.01 + 1e-5) / 2)
    assert alpha_at(100, 0.01, 1e-5, 100) == pytest.approx(1e-5)
    assert alpha_at(7, 0.01, 1e-5, 0) == 1e-5  # no schedule: alpha_end throughout
    assert [s for s in range(1, 10) if is_update_step(s, 3)] == [3, 6, 9] and not is_update_step(0, 1)


def _perturbed_copy(source: Path, target: Path, seed: int) -> Path:
    """A policy checkpoint: the source folder with every weight moved by seeded noise, plus optimizer state."""
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    save_file(
        {k: (v + 0.1 * torch.randn(v.shape, generator=g)).contiguous() for k, v in weights.items()},
        str(target / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (target / "optimizer.pt").write_bytes(b"adam state")
    return target


def test_ema_weights_equal_a_hand_rolled_ema_of_the_saved_policies(tiny_model_path, tmp_path):
    policies = [_perturbed_copy(tiny_model_path, tmp_path / f"policy_{k}", seed=k) for k in (1, 2, 3)]
    alphas = [0.5, 0.25, 0.1]
    teacher = Path(tiny_model_path)
    expected = {k: v.double() for k, v in load_file(teacher / "model.safetensors").items()}
    for k, (policy, alpha) in enumerate(zip(policies, alphas)):
        out = tmp_path / f"teacher_{k}"
        out.mkdir()
        ema_checkpoint(teacher, policy, alpha, out)
        teacher = out
        p = load_file(policy / "model.safetensors")
        expected = {name: alpha * p[name].double() + (1 - alpha) * expected[name] for name in expected}
    got = load_file(teacher / "model.safetensors")
    assert set(got) == set(expected)
    for name, value in got.items():
        torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
    # weights moved: the teacher is neither the start nor the last policy
    last = load_file(policies[-1] / "model.safetensors")
    assert any(not torch.equal(got[n], last[n]) for n in got)
    assert (teacher / "config.json").exists() and not (teacher / "optimizer.pt").exists()
    from refiner_core.models import load_model

    load_model(teacher)  # an HF checkpoint the rollout engine can load


def _bf16_checkpoint(source: Path, target: Path, weights: dict[str, torch.Tensor]) -> Path:
    """An HF checkpoint as a bf16 run writes it: the source's files, config dtype bfloat16, `weights` in bf16."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
        str(target / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return target


def test_a_bf16_policys_teacher_is_kept_in_fp32_and_follows_the_exact_ema(tiny_model_path, tmp_path):
    """At alpha 0.01, alpha * (policy - teacher) is far below half a bf16 ulp of most weights: the teacher is stored
    in fp32, so over several updates from bf16 policies it tracks a float64 EMA of them to within fp32 rounding,
    and a bf16 run still loads it in bf16 (learners, the hf engine's checkpoint sync)."""
    from refiner_core.config import EngineSettings
    from refiner_core.models import checkpoint_weights, load_model
    from refiner_core.rollout.hf_engine import make_hf_engine

    start = {k: v.double() for k, v in load_file(tiny_model_path / "model.safetensors").items()}
    teacher = _bf16_checkpoint(tiny_model_path, tmp_path / "start", start)
    expected = {k: v.to(torch.bfloat16).double() for k, v in start.items()}
    g = torch.Generator().manual_seed(0)
    drift = {k: 1e-3 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in start.items()}
    for step in range(1, 6):  # the policy drifts away step by step, as training moves it
        policy = _bf16_checkpoint(
            tiny_model_path, tmp_path / f"policy_{step}", {k: v + step * drift[k] for k, v in start.items()}
        )
        out = tmp_path / f"teacher_{step}"
        out.mkdir()
        ema_checkpoint(teacher, policy, 0.01, out)
        teacher = out
        saved = load_file(policy / "model.safetensors")
        expected = {k: 0.01 * saved[k].double() + 0.99 * v for k, v in expected.items()}
    got = load_file(teacher / "model.safetensors")
    for name, value in got.items():
        assert value.dtype == torch.float32, name
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-9)
    moved = sum(int((v.to(torch.bfloat16) != start[k].to(torch.bfloat16)).sum()) for k, v in got.items())
    assert moved > 0.5 * sum(v.numel() for v in got.values())  # even rounded to bf16, most weights moved

    in_bf16 = {name: value.to(torch.bfloat16) for name, value in got.items()}
    loaded = load_model(teacher, "bfloat16", device="cpu").state_dict()
    assert all(loaded[n].dtype == torch.bfloat16 and torch.equal(loaded[n], v) for n, v in in_bf16.items())
    engine = make_hf_engine(str(tmp_path / "start"), EngineSettings.of(), dtype="bfloat16")
    engine.load_weights(checkpoint_weights(teacher))
    synced = engine.model.state_dict()
    assert all(synced[n].dtype == torch.bfloat16 and torch.equal(synced[n], v) for n, v in in_bf16.items())


def test_ema_refuses_another_model_and_alpha_outside_0_1(tiny_model_path, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    save_file({"unrelated.weight": torch.zeros(2)}, str(other / "model.safetensors"))
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="not the same model"):
        ema_checkpoint(other, tiny_model_path, 0.5, tmp_path / "out")
    with pytest.raises(ValueError, match="alpha"):
        ema_checkpoint(tiny_model_path, tiny_model_path, 1.5, tmp_path / "out")


TINY = [
    *TINY_ON_CPU,
    "rollout.samples_per_prompt=4",
    "rollout.prompts_per_step=2",
    "rollout.max_new_tokens=12",
    "rollout.batch_size=16",
    "grpo.steps=2",
    "grpo.learning_rate=1e-2",
    "grpo.micro_batch_size=8",
    "eval.every=0",
    "teacher.alpha_start=0.5",
    "teacher.alpha_end=0.1",
    "teacher.schedule_steps=4",
    "teacher.update_interval=1",
]


def test_co_rewarding_2_resumes_its_teacher_after_a_kill(api_env, tmp_path):
    """Killed right before the second teacher update, the rerun finishes it from the files on disk: the final
    teacher is the hand-rolled EMA start -> step_0001 -> step_0002 with the scheduled alphas, and the catalog holds
    the teacher's rollouts, alpha per step and the teacher-voted labels."""
    run_dir = tmp_path / "co2"
    args = ["run", "recipes/co-rewarding-2.yaml", "--run-dir", str(run_dir), *[x for o in TINY for x in ("--set", o)]]
    code, out, err, _ = run_cli(args, tmp_path, env={**api_env, "REFINER_KILL_ONCE": "teacher-update@1"})
    assert code != 0 and not (run_dir / "teacher" / "step_0002").exists(), (out, err)
    assert (run_dir / "teacher" / "step_0001").exists()
    code, out, err, _ = run_cli(args, tmp_path, api_env)
    assert code == 0, (out, err)

    start = load_file(
        Path(catalog_rows(run_dir, "SELECT policy FROM teacher_rollouts WHERE step = 0 LIMIT 1")[0][0])
        / "model.safetensors"
    )
    teacher = {k: v.double() for k, v in start.items()}
    for step, alpha in ((1, alpha_at(1, 0.5, 0.1, 4)), (2, alpha_at(2, 0.5, 0.1, 4))):
        policy = load_file(run_dir / "checkpoints" / f"step_{step:04d}" / "model.safetensors")
        teacher = {k: alpha * policy[k].double() + (1 - alpha) * teacher[k] for k in teacher}
    final = load_file(run_dir / "teacher" / "step_0002" / "model.safetensors")
    for name, value in final.items():
        torch.testing.assert_close(value.double(), teacher[name], atol=1e-6, rtol=0)

    _rerun_keeping_one_checkpoint(args, run_dir, tmp_path, api_env)
    updates = catalog_rows(run_dir, "SELECT step, alpha, updated, teacher FROM teacher_updates ORDER BY step")
    assert [(s, round(a, 9), u, Path(t).name) for s, a, u, t in updates] == [
        (0, round(alpha_at(1, 0.5, 0.1, 4), 9), True, "step_0001"),
        (1, 0.3, True, "step_0002"),
    ]
    used = catalog_rows(
        run_dir, "SELECT step, any_value(policy), count(*) FROM teacher_rollouts GROUP BY step ORDER BY step"
    )
    assert [(s, n) for s, _, n in used] == [(0, 8), (1, 8)] and Path(used[1][1]).name == "step_0001"
    # the policy's labels are the majority of the teacher's answers to the same prompt at the same step
    teacher_votes: dict = {}
    for step, pid, text in catalog_rows(
        run_dir, "SELECT step, prompt_id, response_text FROM teacher_rollouts ORDER BY step, prompt_id, sample_idx"
    ):
        teacher_votes.setdefault((step, pid), []).append(vote_of(text))
    labels = catalog_rows(
        run_dir,
        "SELECT DISTINCT step, prompt_id, label_source, pseudo_label, label_votes, label_voters FROM reward_inputs",
    )
    assert len(labels) == 4 and {key for key in teacher_votes} == {(s, p) for s, p, *_ in labels}
    for step, pid, source, label, votes, voters in labels:
        expected = majority_vote(teacher_votes[(step, pid)])
        assert source == "teacher" and (label, votes, voters) == (expected.label, expected.votes, expected.voters)
    assert catalog_rows(run_dir, "SELECT count(*) FROM rewards WHERE pseudo_label IS NULL AND reward <> 0") == [(0,)]


def _rerun_keeping_one_checkpoint(args: list[str], run_dir: Path, tmp_path: Path, api_env: dict) -> None:
    """run.keep_last=1 on the finished run: the older policy and teacher checkpoints go, every stage that named
    them stays Cached (pruned on purpose, not damaged)."""
    code, out, err, _ = run_cli([*args, "--set", "run.keep_last=1"], tmp_path, api_env)
    assert code == 0, (out, err)
    assert sorted(p.name for p in (run_dir / "teacher").glob("step_*")) == ["step_0002"]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_0002"]
    for name in ("rollout[step=1]", "teacher-rollout[step=1]", "teacher-update[step=0]", "teacher-update[step=1]"):
        assert f"Task run '{name}' - Finished in state Cached" in err, name
    assert "recomputing" not in err
