"""What a run carries from step to step beside the policy, replayed from the cached stages when it resumes or is
extended: the KL reference that grpo.ref_sync_every moves toward the policy (TRL sync_ref_model), the coefficient
of grpo.adaptive_entropy (TRL use_adaptive_entropy), and that of the KL in the reward (grpo.kl_reward_target, verl's
adaptive kl_ctrl)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import catalog_rows, run_cli

# ref_mixup_alpha 1: the reference becomes the policy, so the next update's KL is exactly 0 where it reads it;
# an entropy target no entropy reaches: the bonus grows by the delta each step, from 0 (nothing measured yet); the
# KL in the reward, 0 against a reference that is the policy, so its coefficient falls by the clipped 20 % x 16
# responses / horizon 16 each step: 0.1, 0.08, 0.064
SYNCED = [
    "grpo.ref_sync_every=1",
    "grpo.ref_mixup_alpha=1",
    "grpo.beta=0.05",
    "grpo.learning_rate=1e-2",
    "grpo.adaptive_entropy=true",
    "grpo.entropy_target=100",
    "grpo.entropy_coef_delta=0.01",
    "grpo.kl_reward_coef=0.1",
    "grpo.kl_reward_target=0.01",
    "grpo.kl_reward_horizon=16",
]


def test_the_reference_and_the_entropy_coefficient_carry_over_to_a_longer_run(api_env, tmp_path):
    run_dir = tmp_path / "tiny"
    args = ["run", "recipes/tiny.yaml", "--run-dir", str(run_dir), *[x for o in SYNCED for x in ("--set", o)]]
    code, out, err, _ = run_cli(args, tmp_path, api_env)
    assert code == 0, (out, err)
    syncs = catalog_rows(run_dir, "SELECT step, alpha, reference, previous FROM reference_syncs ORDER BY step")
    assert [(s, a, Path(r).relative_to(run_dir).as_posix()) for s, a, r, _ in syncs] == [
        (0, 1.0, "reference/step_0001"),
        (1, 1.0, "reference/step_0002"),
    ]
    assert syncs[1][3] == syncs[0][2]  # each sync moves the last one
    for step in (1, 2):
        reference = load_file(run_dir / "reference" / f"step_{step:04d}" / "model.safetensors")
        policy = load_file(run_dir / "checkpoints" / f"step_{step:04d}" / "model.safetensors")
        assert reference.keys() == policy.keys() and all(torch.equal(reference[k], policy[k]) for k in policy)
    # step 1's update measured its KL against the policy it started from
    assert catalog_rows(run_dir, "SELECT step, kl FROM steps ORDER BY step") == [(0, 0.0), (1, 0.0)]
    assert catalog_rows(run_dir, "SELECT entropy_coef FROM steps ORDER BY step") == [(0.0,), (0.01,)]
    kl_in_reward = catalog_rows(run_dir, "SELECT kl_reward_coef, reward_kl FROM steps ORDER BY step")
    assert kl_in_reward == [(0.1, 0.0), (pytest.approx(0.08, rel=1e-12), 0.0)]

    # one step more, keeping one checkpoint: steps 0-1 Cached, step 2 reads the reference step 1 moved
    code, out, err, _ = run_cli([*args, "--set", "grpo.steps=3", "--set", "run.keep_last=1"], tmp_path, api_env)
    assert code == 0, (out, err)
    for name in ("grpo-update[step=1]", "reference-sync[step=0]", "reference-sync[step=1]"):
        assert f"Task run '{name}' - Finished in state Cached" in err, name
    assert catalog_rows(run_dir, "SELECT kl, entropy_coef FROM steps WHERE step = 2") == [(0.0, 0.02)]
    [(coef, kl)] = catalog_rows(run_dir, "SELECT kl_reward_coef, reward_kl FROM steps WHERE step = 2")
    assert coef == pytest.approx(0.064, rel=1e-12) and kl == 0.0
    assert sorted(p.name for p in (run_dir / "reference").glob("step_*")) == ["step_0003"]
