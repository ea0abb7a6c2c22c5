"""The 'deepspeed' learner for real: torchrun subprocesses, ZeRO-3 on CPU (gloo), the tiny Qwen3."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import learner_settings
from refiner_core.learners.base import TrainSample, make_learner
from refiner_core.learners.deepspeed_learner import LearnerDied
from refiner_core.learners.torch_learner import TorchLearner
from refiner_core.models import checkpoint_weights, load_model
from refiner_core.runtime import scratch
from refiner_core.runtime.procs import process_identity
from test_live_engines import _log, _results, _same

pytestmark = pytest.mark.slow


def _samples(seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    return [
        TrainSample(
            torch.randint(3, 2000, (12 + 3 * k,), generator=g).tolist(),
            torch.randint(3, 2000, (6 + 2 * k,), generator=g).tolist(),
            adv,
            (-7.0 - torch.rand(6 + 2 * k, generator=g)).tolist(),
        )
        for k, adv in enumerate([1.0, -1.0, 0.5, -0.5, 1.2, -0.3])
    ]


def _settings(**kw):
    return learner_settings(
        **{
            "learning_rate": 1e-3,
            "weight_decay": 0.01,
            "max_grad_norm": 1.0,
            "beta": 0.04,
            "micro_batch_size": 2,
            "tis_cap": 2.0,
            **kw,
        }
    )


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_two_rank_zero3_equals_the_torch_learner_kept_up_and_resumed(
    tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch
):
    """6 sequences in 3 micro-batches of 2 over 2 ranks (rank 1 pads with a zero-weight copy), fp32, clipping, KL
    and TIS on, two AdamW steps at lr 1e-3. Measured (also with one rank, so it is DeepSpeed's fp32 arithmetic, not
    the sharding): losses equal to 4e-9, grad norm to 1.4e-5 relative, weights to 8e-6 max abs, i.e. 0.8% of one
    step's move (Adam moves every weight by ~lr); the bounds below leave 2-7x headroom.

    The ranks are launched once and take both steps (optimizer state in memory); a second launch from the first
    step's checkpoint resumes DeepSpeed's optimizer state from disk and gives the same second step. The ranks
    compile none of DeepSpeed's ops (its CPU shared-memory all-reduce cost 1-2 min in every new environment)."""
    samples = [_samples(0), _samples(1)]
    extensions = tmp_path / "torch_extensions"  # a new environment's: the ranks compile no DeepSpeed op into it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    # The reference: the one-process torch learner, two train steps with its own optimizer.
    policy = load_model(tiny_model_path, trainable=True)
    torch_learner = TorchLearner(policy, load_model(tiny_model_path), tiny_tokenizer.pad_token_id, _settings())
    expected, expected_weights = [], []
    for batch in samples:
        expected.append(torch_learner.train_step(batch))
        expected_weights.append({k: v.detach().clone() for k, v in policy.state_dict().items()})

    settings = _settings(world_size=2, zero_stage=3)
    base = Path(tiny_model_path)
    kept = make_learner("deepspeed", base, tiny_model_path, tiny_tokenizer, settings, base / "optimizer.pt")
    try:
        for step, batch in enumerate(samples):
            metrics = kept.train_step(batch)
            out = tmp_path / f"step_{step + 1}"
            kept.save(out)
            _check_step(kept, metrics, batch, out, expected[step], expected_weights[step], resumed=0, step=step)
            # The weights a live rollout engine copies are the checkpoint's.
            exported = kept.weights()
            assert _max_diff(exported, {k: v for k, v in load_model(out).state_dict().items() if k in exported}) == 0
        # grpo.kl_reward_coef's measure on the ranks (each scores every sample) equals the one-process learner's
        want, got = torch_learner.sequence_kl(samples[0]), kept.sequence_kl(samples[0])
        assert [m.total for m in got] == pytest.approx([m.total for m in want], rel=1e-3, abs=1e-6)
        assert min(abs(m.total) for m in want) > 1e-4
        assert [m.reference_logprobs for m in got] == [pytest.approx(m.reference_logprobs, abs=1e-5) for m in want]
        launcher = kept._proc.pid
    finally:
        kept.close()
    assert process_identity(launcher) is None, "close() stops the ranks"
    assert not kept.work.exists() and not kept.export.exists()
    with pytest.raises(LearnerDied, match="closed"):
        kept.train_step(samples[0])

    resumed = make_learner(
        "deepspeed",
        tmp_path / "step_1",
        tiny_model_path,
        tiny_tokenizer,
        settings,
        tmp_path / "step_1" / "optimizer.pt",
    )
    try:
        metrics = resumed.train_step(samples[1])
        resumed.save(tmp_path / "resumed")
        _check_step(
            resumed, metrics, samples[1], tmp_path / "resumed", expected[1], expected_weights[1], resumed=1, step=1
        )
    finally:
        resumed.close()
    assert _max_diff(load_model(tmp_path / "resumed").state_dict(), load_model(tmp_path / "step_2").state_dict()) == 0
    moved = _max_diff(expected_weights[1], load_model(tiny_model_path).state_dict())
    assert moved > 1e-3  # the weights really changed, by far more than the tolerance
    assert not extensions.exists() or not any(extensions.iterdir()), list(extensions.iterdir())


def test_lora_on_two_zero3_ranks_equals_the_torch_learner(tiny_model_path, tiny_tokenizer, tmp_path):
    """model.lora_rank with the deepspeed learner: the ranks train PEFT adapters (ZeRO-3 partitions the frozen
    base too), the reference is the policy with its adapters off, a checkpoint holds the adapter alone, the adapter
    exported for an engine is gathered from its partitions, and a relaunch resumes adapter and AdamW state."""
    from safetensors.torch import load_file

    from refiner_core.learners.torch_learner import make_torch_learner
    from refiner_core.models import checkpoint_adapter

    lora = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=("all-linear",))
    samples = [_samples(0), _samples(1)]
    torch_learner = make_torch_learner(
        tiny_model_path, tiny_model_path, tiny_tokenizer, _settings(learning_rate=1e-2, **lora), None
    )
    expected = [torch_learner.train_step(batch) for batch in samples[:1]]
    expected_weights = [torch_learner.weights()]
    expected_adapter = [load_file(str(Path(torch_learner.adapter().path) / "adapter_model.safetensors"))]
    expected.append(torch_learner.train_step(samples[1]))
    expected_weights.append(torch_learner.weights())
    torch_learner.close()

    settings = _settings(learning_rate=1e-2, world_size=2, zero_stage=3, **lora)
    base = Path(tiny_model_path)
    kept = make_learner("deepspeed", base, base, tiny_tokenizer, settings, base / "optimizer.pt")
    try:
        metrics = kept.train_step(samples[0])
        kept.save(tmp_path / "step_1")
        adapter = kept.adapter()
        exported = load_file(str(Path(adapter.path) / "adapter_model.safetensors"))
        assert adapter.base == str(base.resolve()) and adapter.rank == 4
        assert _max_diff(exported, expected_adapter[0]) < 1e-5
        weights = kept.weights()  # a checkpoint's tensors: the tied output layer is left out
        assert _max_diff(weights, {k: v for k, v in expected_weights[0].items() if k in weights}) < 1e-5
        for key in ("loss", "pg_loss", "kl", "clip_fraction"):
            assert metrics[key] == pytest.approx(expected[0][key], rel=1e-5, abs=1e-7), key
        kept.train_step(samples[1])
        kept.save(tmp_path / "step_2")
    finally:
        kept.close()
    assert not Path(adapter.path).parent.exists(), "closing the learner deletes its exported adapters"
    step_1 = tmp_path / "step_1"
    assert checkpoint_adapter(step_1) is not None and not list(step_1.glob("*.safetensors"))  # the adapter alone
    assert (step_1 / "deepspeed" / "refiner.json").exists()
    diff = _max_diff(load_model(tmp_path / "step_2").state_dict(), expected_weights[1])
    assert diff < 1e-5, diff
    assert _max_diff(expected_weights[1], load_model(tiny_model_path).state_dict()) > 1e-3  # they really moved

    resumed = make_learner("deepspeed", step_1, base, tiny_tokenizer, settings, step_1 / "optimizer.pt")
    try:
        got = resumed.train_step(samples[1])
        assert [r["adam_steps_resumed"] for r in resumed.rank_stats] == [1, 1]
        weights = resumed.weights()
        assert (
            _max_diff(weights, {k: v for k, v in load_model(tmp_path / "step_2").state_dict().items() if k in weights})
            < 1e-6
        )
    finally:
        resumed.close()
    for key in ("loss", "pg_loss", "kl"):
        assert got[key] == pytest.approx(expected[1][key], rel=1e-5, abs=1e-7), key


def _check_step(learner, metrics, batch, out, want, want_weights, resumed: int, step: int) -> None:
    # Both ranks trained their share: 2 + 1 real micro-batches, every response token counted once.
    stats = sorted(learner.rank_stats, key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"], r["micro_batches"]) for r in stats] == [(0, 2, 2), (1, 2, 1)]
    assert sum(r["tokens"] for r in stats) == sum(len(s.response_ids) for s in batch)
    assert all(r["tokens"] > 0 for r in stats)
    # Adam's step count: resumed from the checkpoint at launch, then one per train step.
    assert [(r["adam_steps_resumed"], r["adam_steps"]) for r in stats] == [(resumed, step + 1)] * 2
    assert set(metrics) == set(want)
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "response_tokens", "packing_efficiency", "lr"):
        assert metrics[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    # An HF checkpoint any transformers user can load, with the one-process learner's weights.
    diff = _max_diff(load_model(out).state_dict(), want_weights)
    assert diff < 0.02 * 1e-3, diff
    assert (out / "deepspeed" / "refiner.json").exists()


def test_epochs_on_two_zero3_ranks_equal_the_torch_learner(tiny_model_path, tiny_tokenizer, tmp_path):
    """grpo.epochs 2 with minibatches 2: each rank runs its share of both passes over one batch (pi_old frozen
    before the first step), four AdamW steps at the step's scheduled rate (not the settings' 1e-3); loss, grad norm
    and weights as the torch learner's. policy_loss clip_cov: each rank draws the tokens it cuts as the torch
    learner does, per micro-batch and pass. The samples carry pi_old and pi_ref from a measure before the update
    (grpo.kl_reward_coef's), which both learners read instead of scoring them."""
    kw = dict(epochs=2, minibatches=2, policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    policy = load_model(tiny_model_path, trainable=True)
    reference = load_model(tiny_model_path)
    torch_learner = TorchLearner(policy, reference, tiny_tokenizer.pad_token_id, _settings(**kw))
    carried = [
        dataclasses.replace(s, **m.carried()) for s, m in zip(_samples(0), torch_learner.sequence_kl(_samples(0)))
    ]
    want = torch_learner.train_step(carried, learning_rate=4e-4)
    plain = TorchLearner(
        load_model(tiny_model_path, trainable=True),
        reference,
        tiny_tokenizer.pad_token_id,
        _settings(epochs=2, minibatches=2),
    ).train_step(_samples(0), learning_rate=4e-4)
    assert want["clip_fraction"] > plain["clip_fraction"] + 0.1  # int(a fifth) of each micro-batch cut, beside the clip
    settings = _settings(world_size=2, zero_stage=3, **kw)
    base = Path(tiny_model_path)
    learner = make_learner("deepspeed", base, tiny_model_path, tiny_tokenizer, settings, base / "optimizer.pt")
    try:
        metrics = learner.train_step(carried, learning_rate=4e-4)
        learner.save(tmp_path / "out")
    finally:
        learner.close()
    assert [r["adam_steps"] for r in learner.rank_stats] == [4, 4]
    assert metrics["lr"] == want["lr"] == 4e-4
    for key in ("loss", "pg_loss", "kl", "clip_fraction"):
        assert metrics[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    diff = _max_diff(load_model(tmp_path / "out").state_dict(), {k: v.detach() for k, v in policy.state_dict().items()})
    assert diff < 0.02 * 1e-3, diff


def test_zero_stage_0_reports_the_torch_learners_grad_norm(tiny_model_path, tiny_tokenizer, tmp_path):
    """At ZeRO stage 0 outside its bf16 mode DeepSpeed steps torch's AdamW itself and its clipping keeps no norm
    (get_global_grad_norm() is None): the ranks clip after DeepSpeed's all-reduce, as the torch learner does, and
    report the norm before clipping (2.5 here, so max_grad_norm 1.0 clips). Loss, grad norm and weights as the
    torch learner's, bounds as above."""
    policy = load_model(tiny_model_path, trainable=True)
    want = TorchLearner(policy, load_model(tiny_model_path), tiny_tokenizer.pad_token_id, _settings()).train_step(
        _samples(0)
    )
    assert want["grad_norm"] > 1.0
    base = Path(tiny_model_path)
    settings = _settings(world_size=2, zero_stage=0)
    learner = make_learner("deepspeed", base, tiny_model_path, tiny_tokenizer, settings, base / "optimizer.pt")
    try:
        metrics = learner.train_step(_samples(0))
        learner.save(tmp_path / "out")
    finally:
        learner.close()
    assert math.isfinite(metrics["grad_norm"])
    weights = {k: v.detach() for k, v in policy.state_dict().items()}
    _check_step(learner, metrics, _samples(0), tmp_path / "out", want, weights, resumed=0, step=0)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_nan_gradient_skips_the_step_on_every_rank(tiny_model_path, tiny_tokenizer, tmp_path, zero_stage):
    """An overflowing advantage on rank 0's share makes NaN gradients; after the all-reduce every rank holds them.
    Stage 3: DeepSpeed's ZeRO optimizer skips the step and reports an infinite norm; stage 0 (DeepSpeed steps torch's
    AdamW): the ranks' clipping hook drops the gradients, so AdamW passes over every weight. Either way the weights
    and Adam's step count stay as they were and the next step is the torch learner's first."""
    poisoned = [dataclasses.replace(_samples(0)[0], advantage=3e38), *_samples(0)[1:]]
    policy = load_model(tiny_model_path, trainable=True)
    want = TorchLearner(policy, load_model(tiny_model_path), tiny_tokenizer.pad_token_id, _settings()).train_step(
        _samples(1)
    )
    weights = {k: v.detach() for k, v in policy.state_dict().items()}
    base = Path(tiny_model_path)
    settings = _settings(world_size=2, zero_stage=zero_stage)
    learner = make_learner("deepspeed", base, tiny_model_path, tiny_tokenizer, settings, base / "optimizer.pt")
    try:
        skipped = learner.train_step(poisoned)
        assert skipped["skipped_optimizer_steps"] == 1 and skipped["grad_norm"] is None
        assert [r["adam_steps"] for r in learner.rank_stats] == [0, 0]
        learner.save(tmp_path / "skipped")
        metrics = learner.train_step(_samples(1))
        learner.save(tmp_path / "out")
    finally:
        learner.close()
    assert _max_diff(load_model(tmp_path / "skipped").state_dict(), load_model(tiny_model_path).state_dict()) == 0
    assert metrics["skipped_optimizer_steps"] == 0
    _check_step(learner, metrics, _samples(1), tmp_path / "out", want, weights, resumed=0, step=0)


def test_two_hosts_on_loopback_equal_one_host(tiny_model_path, tiny_tokenizer, tmp_path):
    """grpo.deepspeed.hostfile with two hosts of one slot each (localhost and 127.0.0.1: two launchers on this
    machine, as on two machines), the run starting the first host's rank and the test the second's with the command
    the learner gives (launch_over_ssh false): the same loss, grad norm and weights as one host's two ranks, i.e. as
    the torch learner (bounds as above). Job folders go to the shared work_root."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two hosts, one rank each\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    policy = load_model(tiny_model_path, trainable=True)
    want = TorchLearner(policy, load_model(tiny_model_path), tiny_tokenizer.pad_token_id, _settings()).train_step(
        _samples(0)
    )
    settings = _settings(
        world_size=2, zero_stage=3, hostfile=str(hostfile), launch_over_ssh=False, work_root=str(tmp_path / "shared")
    )
    base = Path(tiny_model_path)
    learner = make_learner("deepspeed", base, tiny_model_path, tiny_tokenizer, settings, base / "optimizer.pt")
    assert learner.work.parent == tmp_path / "shared"
    learner.start()
    [command] = learner.other_hosts
    assert command[command.index("--node_rank") + 1] == "1" and command[-1] == str(learner.work)
    second = subprocess.Popen(
        command, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, start_new_session=True
    )
    try:
        metrics = learner.train_step(_samples(0))
        learner.save(tmp_path / "out")
    finally:
        learner.close()
        assert second.wait(60) == 0, "the second host's ranks end with the run's 'stop'"
    _check_step(
        learner,
        metrics,
        _samples(0),
        tmp_path / "out",
        want,
        {k: v.detach() for k, v in policy.state_dict().items()},
        resumed=0,
        step=0,
    )


def test_hostfile_slots_must_match_world_size(tiny_model_path, tiny_tokenizer, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    with pytest.raises(ValueError, match="has 2 slots over 1 host.*world_size is 1"):
        make_learner(
            "deepspeed", tiny_model_path, tiny_model_path, tiny_tokenizer, _settings(hostfile=str(hostfile)), None
        )
    hostfile.write_text("localhost 2\n")
    with pytest.raises(ValueError, match="hostfile:1: expected 'HOST slots=N'"):
        make_learner(
            "deepspeed", tiny_model_path, tiny_model_path, tiny_tokenizer, _settings(hostfile=str(hostfile)), None
        )


def test_a_rank_that_dies_fails_the_step_clearly(tiny_model_path, tiny_tokenizer):
    """A rank killed between steps: the next step raises LearnerDied with the ranks' log, and nothing is left, torch
    elastic's folder included (kept in the learner's work folder)."""
    base = Path(tiny_model_path)
    learner = make_learner("deepspeed", base, tiny_model_path, tiny_tokenizer, _settings(), base / "optimizer.pt")
    try:
        learner.train_step(_samples(0))
        assert list(learner.work.glob("torchelastic_*"))
        launcher = learner._proc.pid
        ranks = [
            int(p)
            for p in subprocess.run(["pgrep", "-f", str(learner.work)], capture_output=True, text=True).stdout.split()
            if int(p) != launcher
        ]
        assert ranks, "the rank runs until the learner is closed"
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        assert learner.alive
        with pytest.raises(LearnerDied, match="exited with .* during a 'train' job"):
            learner.train_step(_samples(1))
        assert not learner.alive  # a run does not keep it for a retry (live_learner.keep_learner)
    finally:
        learner.close()
    assert process_identity(launcher) is None and not learner.work.exists()


def test_ranks_that_hang_mid_update_fail_the_stage_as_stalled(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    """Ranks alive but stopped (SIGSTOP: a stuck collective) during a train step: the update's bar, moved by rank 0's
    micro-batches, stops, the watchdog fails the stage after run.stall_seconds, and the ranks are gone when close
    returns (the learner waited for them forever: it showed no progress, so nothing watched it; then a stopped
    rank, which holds the SIGTERM it is sent, outlived close: the ranks sit in sessions of their own, outside the
    launcher's group). The ranks are in the run folder's process list while they run, for the next run to stop."""
    import logging

    from refiner_core.runtime.procs import PROCS_DIR_ENV
    from refiner_core.runtime.progress import Stalled
    from tasks import progress

    monkeypatch.setenv(PROCS_DIR_ENV, str(tmp_path / "procs"))
    base = Path(tiny_model_path)
    learner = make_learner("deepspeed", base, tiny_model_path, tiny_tokenizer, _settings(), base / "optimizer.pt")
    progress.configure(stall_seconds=2.0, progress_every=0)
    launcher, ranks = None, []
    try:
        learner.train_step(_samples(0))
        assert (learner.work / "job_0001" / "progress").read_text() == "3"  # rank 0's micro-batches of the step
        launcher = learner._proc.pid
        ranks = [
            int(p)
            for p in subprocess.run(["pgrep", "-f", str(learner.work)], capture_output=True, text=True).stdout.split()
            if int(p) != launcher
        ]
        assert ranks and {int(p.stem) for p in (tmp_path / "procs").glob("*.json")} == {launcher, *ranks}
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        with pytest.raises(Stalled, match=r"grpo-update\[step=1\] stalled: no progress .* while update at 0 mb"):
            with progress.watched_stage("grpo-update[step=1]", logging.getLogger("test")):
                learner.train_step(_samples(1))
        assert not learner.alive
    finally:
        progress.configure(stall_seconds=1800.0, progress_every=30.0)
        learner.close()
        left = [pid for pid in [launcher, *ranks] if pid and process_identity(pid)]
        for pid in ranks:  # on failure, nothing stays stopped beyond the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert left == [] and list((tmp_path / "procs").glob("*.json")) == []


def test_flow_keeps_the_ranks_up_and_gives_the_same_run(
    prefect_server, tiny_recipe, tmp_path, info_logs, capsys, monkeypatch
):
    """Two GRPO steps of the tiny recipe with grpo.learner=deepspeed (one rank, ZeRO-3): ranks kept for the run
    with a checkpoint every 2 steps (step 1's weights live only in the ranks, the rollout engine copies them from
    shared memory) give the same rollouts, rewards, metrics and final weights as ranks launched for every step
    from the checkpoint before (run.keep_engines false); no rank outlives either run, nor do the run's temporary
    folders (the weights in shared memory among them), and the ranks print no warning of DeepSpeed's."""
    from flows.refiner import refiner_pipeline

    grpo = {**tiny_recipe["grpo"], "learner": "deepspeed", "steps": 2, "deepspeed": {"world_size": 1}}
    runs = {"kept": {"keep_engines": True, "save_every": 2}, "fresh": {"keep_engines": False, "save_every": 1}}
    monkeypatch.setenv(RANKS_TAG, tmp_path.name)  # the ranks inherit it: this test's, not another file's
    for name, run in runs.items():
        recipe = {**tiny_recipe, "grpo": grpo, "run": {**tiny_recipe["run"], **run}}
        state = refiner_pipeline(recipe=recipe, run_dir=str(tmp_path / name), return_state=True)
        assert state.is_completed(), state.message
        assert _ranks_left(tmp_path.name) == [], name
        assert not (tmp_path / name / scratch.RECORD).exists()
    ranks_said = capsys.readouterr().err
    assert "[deepspeed rank 0/1] trained" in ranks_said and "is deprecated" not in ranks_said
    kept, fresh = _results(tmp_path / "kept"), _results(tmp_path / "fresh")
    sampled_0 = [[row for row in run["rollouts"] if row[0] == 0] for run in (kept, fresh)]
    assert sampled_0[0] == sampled_0[1], "step 0's rollouts differ: the rollout engine's sampling, before any rank"
    # Step 0 launches fresh ranks from the same model in both runs, and its policy is its reference (KL 0). Now and
    # then a launch's arithmetic differs in the last bits (KL 3.4e-8 and grad norm 9e-7 relative off, the same bits
    # each time; docs/benchmarks.md#the-test-suite): the runs are then the same up to that noise, which is far
    # below what keeping the ranks could break (a step lost or optimizer state dropped moves weights by ~lr).
    start = re.search(r"grpo-update step 0: learner loaded from (\S+)", _log(tmp_path / "fresh")).group(1)
    _same_up_to_launch_noise(kept, fresh, load_model(start))
    one_step_behind = {**fresh, "weights": checkpoint_weights(tmp_path / "fresh" / "checkpoints" / "step_0001")}
    with pytest.raises(AssertionError):  # the tolerance is tight enough to see a step lost
        _same_up_to_launch_noise(kept, one_step_behind, load_model(start))
    if [row for row in kept["steps"] if row[0] == 0] == [row for row in fresh["steps"] if row[0] == 0]:
        _same(kept, fresh)
    else:
        print(f"step 0 differs by launch noise: {kept['steps'][0]} against {fresh['steps'][0]}")
    assert not (tmp_path / "kept" / "checkpoints" / "step_0001").exists()  # never written: save_every 2
    assert (tmp_path / "kept" / "checkpoints" / "step_0002" / "deepspeed" / "refiner.json").exists()
    assert load_model(tmp_path / "kept" / "checkpoints" / "step_0002") is not None
    log = _log(tmp_path / "kept")
    assert "grpo-update step 1: learner kept in memory" in log
    assert "rollout step 1: engine kept, weights synced in place from the learner's memory" in log
    assert "grpo-update step 1: learner loaded from" in _log(tmp_path / "fresh")


def _same_up_to_launch_noise(a: dict, b: dict, start) -> None:
    """Runs `a` and `b` the same but for the last bits of one launch's arithmetic: the same rollouts and rewards,
    step metrics to 1e-5 relative (KL to 1e-6 absolute, 0 at step 0), and final weights that differ by under 1% of
    the mean distance they moved from `start` in two steps."""
    for table in ("rollouts", "rewards"):
        assert a[table] == b[table], table
    assert [row[0] for row in a["steps"]] == [row[0] for row in b["steps"]]
    for (step, *got), (_, *want) in zip(a["steps"], b["steps"]):
        loss, kl, grad_norm = got
        assert loss == pytest.approx(want[0], rel=1e-5, abs=1e-8), (step, got, want)
        assert kl == pytest.approx(want[1], abs=1e-6) and (step > 0 or abs(kl) < 1e-6), (step, got, want)
        assert grad_norm == pytest.approx(want[2], rel=1e-5), (step, got, want)
    before = {k: v.float() for k, v in start.state_dict().items()}
    assert a["weights"].keys() == b["weights"].keys() <= before.keys()
    moved = torch.cat([(b["weights"][k].float() - before[k]).abs().flatten() for k in b["weights"]]).mean()
    apart = torch.cat([(a["weights"][k].float() - b["weights"][k].float()).abs().flatten() for k in a["weights"]])
    assert moved > 0 and apart.mean() < 0.01 * moved, (apart.mean().item(), moved.item())


def _ranks_left(tag: str) -> list[str]:
    """Rank processes (and their launcher) still running that carry `tag` in their environment: those a run of
    this test started, not those of another test file running beside it."""
    found = subprocess.run(["pgrep", "-af", "refiner_core.learners.deepspeed_worker"], capture_output=True, text=True)
    left = []
    for line in found.stdout.splitlines():
        try:
            environment = Path(f"/proc/{line.split()[0]}/environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if f"{RANKS_TAG}={tag}".encode() in environment:
            left.append(line)
    return left


RANKS_TAG = "REFINER_TEST_RANKS_TAG"


@pytest.mark.parametrize(("zero_stage", "chunk"), [(3, 4), (2, 0)])
def test_recomputed_activations_on_a_rank_update_as_the_torch_learner(
    tiny_model_path, tiny_tokenizer, tmp_path, zero_stage, chunk
):
    """grpo.gradient_checkpointing on a ZeRO-3 rank (its layers' parameters gathered again for the recomputation)
    with grpo.logit_chunk_tokens (the output layer's weight gathered for its call and again for its backward), and
    on a ZeRO-2 rank: one step equals the torch learner's, which keeps its activations and whole logits, to the
    bounds of the test above. (Chunks through torch's checkpoint, the output layer called once per chunk, gave
    the same loss at ZeRO-3 and a grad norm of 1.70 against 2.44.)"""
    batch = _samples(0)
    policy = load_model(tiny_model_path, trainable=True)
    expected = TorchLearner(policy, load_model(tiny_model_path), tiny_tokenizer.pad_token_id, _settings()).train_step(
        batch
    )
    settings = _settings(
        zero_stage=zero_stage, share_prompt=False, gradient_checkpointing=True, logit_chunk_tokens=chunk
    )
    learner = make_learner("deepspeed", tiny_model_path, tiny_model_path, tiny_tokenizer, settings, None)
    try:
        metrics = learner.train_step(batch)
        learner.save(tmp_path / "step_1")
    finally:
        learner.close()
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    updated = {k: v for k, v in load_model(tmp_path / "step_1").state_dict().items()}
    assert _max_diff(updated, {k: v for k, v in policy.state_dict().items() if k in updated}) < 3e-5


def test_two_zero3_ranks_with_chunked_logits_and_a_padded_share_equal_the_torch_learner(
    tiny_model_path, tiny_tokenizer
):
    """Two ZeRO-3 ranks share 3 micro-batches, so rank 1 pads with a zero-weight one; with grpo.logit_chunk_tokens
    it goes through the chunked output layer as the scored ones do (whole logits there left the two ranks waiting
    on each other's collectives in the backward pass until gloo's 10-minute timeout). Entropy bonus on: both of
    the chunked function's outputs carry gradients."""
    batch = _samples(0)
    want = TorchLearner(
        load_model(tiny_model_path, trainable=True),
        load_model(tiny_model_path),
        tiny_tokenizer.pad_token_id,
        _settings(entropy_coef=0.01),
    ).train_step(batch)
    settings = _settings(world_size=2, zero_stage=3, share_prompt=False, entropy_coef=0.01, logit_chunk_tokens=4)
    learner = make_learner("deepspeed", tiny_model_path, tiny_model_path, tiny_tokenizer, settings, None)
    try:
        got = learner.train_step(batch)
    finally:
        learner.close()
    assert [r["micro_batches"] for r in learner.rank_stats] == [2, 1]  # rank 1 also runs a zero-weight pad
    for key in ("loss", "pg_loss", "kl", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
