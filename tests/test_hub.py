"""The Hugging Face Hub, offline: `refiner push` picks a complete checkpoint and uploads it without its optimizer
state (the HfApi client is the only stand-in, recording its calls), and `data.format: hub` reads a dataset that
`datasets` has in its local cache with no network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import filter_repo_objects

from conftest import moved_checkpoint, run_cli
from refiner_core.config import load_recipe
from refiner_core.learners.lora import lora_policy, save_lora
from refiner_core.models import load_model, load_tokenizer
from refiner_core.publish.hub import PushError, choose_checkpoint, plan_push, push
from refiner_core.publish.model_card import write_model_card
from refiner_core.store.checkpoints import PRUNED_LIST

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data" / "refiner" / "samples.jsonl"


@pytest.fixture(scope="module")
def run_dir(tiny_model_path, tmp_path_factory) -> Path:
    """A run folder as a run leaves it: step 1 pruned, steps 2 and 3 with weights and cards, the newest with its
    optimizer state (torch and DeepSpeed)."""
    run = tmp_path_factory.mktemp("run")
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml").to_dict()
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    checkpoints = run / "checkpoints"
    for step in (2, 3):
        folder = checkpoints / f"step_{step:04d}"
        shutil.copytree(tiny_model_path, folder)
        write_model_card(folder, run, kind="grpo", run="tiny", step=step)
    newest = checkpoints / "step_0003"
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones(4)
    optimizer.step()
    torch.save(optimizer.state_dict(), newest / "optimizer.pt")
    (newest / "deepspeed" / "global_step3").mkdir(parents=True)
    (newest / "deepspeed" / "global_step3" / "optim_states.pt").write_bytes(b"sharded state")
    (checkpoints / PRUNED_LIST).write_text(json.dumps([str(checkpoints / "step_0001")]))
    return run


class RecordingHub:
    """Stands in for huggingface_hub.HfApi: records the calls; upload_folder raises `error` when given one."""

    def __init__(self, error: Exception | None = None):
        self.calls, self.error = [], error

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        if self.error:
            raise self.error
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/abc")


def test_the_newest_step_is_the_default_and_a_pruned_step_says_what_is_left(run_dir):
    assert choose_checkpoint(run_dir) == run_dir / "checkpoints" / "step_0003"
    assert choose_checkpoint(run_dir, step=2) == run_dir / "checkpoints" / "step_0002"
    with pytest.raises(PushError, match=r"step 1 was pruned .*available steps: 2, 3"):
        choose_checkpoint(run_dir, step=1)
    with pytest.raises(PushError, match=r"step 7 does not exist; available steps: 2, 3"):
        choose_checkpoint(run_dir, step=7)
    with pytest.raises(PushError, match="no SFT checkpoint"):
        choose_checkpoint(run_dir, sft=True)


def test_sft_picks_the_sft_checkpoint_and_its_card(run_dir, tmp_path):
    shutil.copy(run_dir / "recipe.yaml", tmp_path)
    sft = tmp_path / "checkpoints" / "sft"
    shutil.copytree(run_dir / "checkpoints" / "step_0002", sft)
    write_model_card(sft, tmp_path, kind="sft", run="tiny", step=None)
    plan = plan_push(choose_checkpoint(tmp_path, sft=True))
    assert plan.folder == sft and "sft" in plan.card_metadata["tags"] and "grpo" not in plan.card_metadata["tags"]


def test_teacher_picks_the_ema_teachers_checkpoint_and_its_card(run_dir, tmp_path):
    shutil.copy(run_dir / "recipe.yaml", tmp_path)
    with pytest.raises(PushError, match="has no teacher checkpoints"):
        choose_checkpoint(tmp_path, teacher=True)
    for done in (2, 4):
        teacher = tmp_path / "teacher" / f"step_{done:04d}"
        shutil.copytree(run_dir / "checkpoints" / "step_0002", teacher)
        write_model_card(teacher, tmp_path, kind="teacher", run="tiny", step=done, checkpoint=teacher)
    assert choose_checkpoint(tmp_path, teacher=True) == tmp_path / "teacher" / "step_0004"
    plan = plan_push(choose_checkpoint(tmp_path, step=2, teacher=True))
    assert plan.folder == tmp_path / "teacher" / "step_0002" and "teacher" in json.dumps(plan.card_metadata)
    with pytest.raises(PushError, match="step 3 does not exist; available steps: 2, 4"):
        choose_checkpoint(tmp_path, step=3, teacher=True)
    with pytest.raises(PushError, match="exclude each other"):
        choose_checkpoint(tmp_path, sft=True, teacher=True)


def test_the_plan_lists_weights_tokenizer_and_card_but_no_optimizer_state(run_dir):
    plan = plan_push(choose_checkpoint(run_dir))
    names = [name for name, _ in plan.files]
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md"} <= set(names)
    assert not [n for n in names if n.startswith(("optimizer", "deepspeed"))]
    assert dict(plan.files)["model.safetensors"] == (plan.folder / "model.safetensors").stat().st_size
    card = ModelCard.load(plan.folder / "README.md")
    assert plan.card_metadata == card.data.to_dict() and "grpo" in plan.card_metadata["tags"]


def _adapter_on_sft(run: Path, tiny_model_path: Path, merged: bool = False) -> Path:
    """A LoRA run that warm-started with SFT (model.lora_save_merged `merged`): checkpoints/sft, the tiny model
    moved, and step_0001, the adapter trained on it (B drawn at random, as after updates), alone or beside the
    merged weights."""
    overrides = ["model.lora_rank=4", "sft.enabled=true", f"model.lora_save_merged={str(merged).lower()}"]
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", overrides).to_dict()
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    sft = moved_checkpoint(tiny_model_path, run / "checkpoints" / "sft", seed=3)
    settings = SimpleNamespace(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=["all-linear"])
    policy = lora_policy(load_model(sft), None, settings)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=generator)
    step = run / "checkpoints" / "step_0001"
    save_lora(policy, step, merged=merged)
    torch.save({}, step / "optimizer.pt")
    load_tokenizer(tiny_model_path).save_pretrained(step)
    write_model_card(step, run, kind="grpo", run="lora", step=1)
    return step


def test_a_merged_lora_checkpoint_uploads_its_merged_weights_without_the_adapter(tiny_model_path, tmp_path):
    """model.lora_save_merged true: the checkpoint's own merged weights go up, not adapter/, whose config names
    this machine's folder as its base (and PEFT's adapter card the training folder's path)."""
    step = _adapter_on_sft(tmp_path, tiny_model_path, merged=True)
    assert (step / "adapter" / "adapter_config.json").is_file() and (step / "model.safetensors").is_file()
    plan = plan_push(choose_checkpoint(tmp_path))
    names = [name for name, _ in plan.files]
    assert plan.source == step and {"config.json", "model.safetensors", "README.md"} <= set(names)
    assert not [n for n in names if n.startswith(("adapter", "optimizer"))], names


def test_an_adapter_only_lora_checkpoint_uploads_the_policy_merged(tiny_model_path, tmp_path):
    """model.lora_save_merged false, adapters on the run's SFT checkpoint: the push uploads that base with the
    adapter merged, the weights the run sampled from, which load with AutoModelForCausalLM alone; no adapter/. It
    uploaded adapter/ alone, whose card put it on tiny-qwen3 (log-probs 8.2 nats from the run's policy)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    step = _adapter_on_sft(tmp_path, tiny_model_path)
    plan = plan_push(choose_checkpoint(tmp_path))
    assert plan.folder == step and plan.source != step
    names = [name for name, _ in plan.files]
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md"} <= set(names)
    assert not [n for n in names if n.startswith(("adapter", "optimizer"))]
    assert dict(plan.files)["model.safetensors"] == (plan.source / "model.safetensors").stat().st_size
    pushed = AutoModelForCausalLM.from_pretrained(plan.source).state_dict()
    policy = load_model(step).state_dict()  # what the run's engines and evaluations loaded
    assert pushed.keys() == policy.keys() and all(torch.equal(pushed[k], policy[k]) for k in policy)
    on_tiny = PeftModel.from_pretrained(load_model(tiny_model_path), str(step / "adapter")).merge_and_unload()
    assert max((on_tiny.state_dict()[k] - policy[k]).abs().max().item() for k in policy) > 0.01
    assert (plan.source / "README.md").read_text() == (step / "README.md").read_text()
    assert "`refiner push` uploads the merged weights" in (plan.source / "README.md").read_text()

    hub = RecordingHub()
    push(plan, "acme/lora", api=hub)
    upload = hub.calls[-1][2]
    assert upload["folder_path"] == plan.source and upload["commit_message"] == "Upload checkpoints/step_0001"
    on_disk = sorted(p.relative_to(plan.source).as_posix() for p in plan.source.rglob("*") if p.is_file())
    assert list(filter_repo_objects(on_disk, allow_patterns=upload["allow_patterns"])) == names
    staged = plan.source
    del plan
    assert not staged.exists()  # the merged copy goes with the plan

    (tmp_path / "checkpoints" / "sft").rename(tmp_path / "elsewhere")
    with pytest.raises(PushError, match=r"applies to the base model .*/checkpoints/sft, which is not there"):
        plan_push(step)


def test_an_incomplete_checkpoint_or_a_card_without_metadata_is_refused(run_dir, tmp_path):
    folder = tmp_path / "step_0003"
    shutil.copytree(run_dir / "checkpoints" / "step_0003", folder)
    (folder / "model.safetensors").unlink()
    (folder / "README.md").unlink()
    with pytest.raises(PushError, match=r"missing weights .*, the model card README.md"):
        plan_push(folder)
    shutil.copy(run_dir / "checkpoints" / "step_0002" / "model.safetensors", folder)
    (folder / "README.md").write_text("a card without metadata\n")
    with pytest.raises(PushError, match="no metadata block"):
        plan_push(folder)
    (folder / "README.md").write_text("---\ntags: [grpo\n---\nA card whose metadata is broken YAML\n")
    with pytest.raises(PushError, match="not a parseable model card"):
        plan_push(folder)


def test_push_creates_the_repo_and_branch_and_uploads_only_the_planned_files(run_dir):
    plan = plan_push(choose_checkpoint(run_dir))
    hub = RecordingHub()
    url = push(plan, "acme/tiny-grpo", private=True, revision="step-3", api=hub)
    assert url == "https://huggingface.co/acme/tiny-grpo/commit/abc"
    assert [c[:2] for c in hub.calls] == [
        ("create_repo", "acme/tiny-grpo"),
        ("create_branch", "acme/tiny-grpo"),
        ("upload_folder", "acme/tiny-grpo"),
    ]
    assert hub.calls[0][2] == {"private": True, "exist_ok": True}
    assert hub.calls[1][2] == {"branch": "step-3", "exist_ok": True}
    upload = hub.calls[2][2]
    assert upload["folder_path"] == plan.folder and upload["revision"] == "step-3"
    assert upload["commit_message"] == "Upload checkpoints/step_0003"
    # the selection huggingface_hub's upload_folder makes from these patterns
    on_disk = sorted(p.relative_to(plan.folder).as_posix() for p in plan.folder.rglob("*") if p.is_file())
    assert "optimizer.pt" in on_disk and "deepspeed/global_step3/optim_states.pt" in on_disk
    uploaded = list(
        filter_repo_objects(on_disk, allow_patterns=upload["allow_patterns"], ignore_patterns=upload["ignore_patterns"])
    )
    assert uploaded == [name for name, _ in plan.files]
    assert (
        list(filter_repo_objects(["optimizer.pt", "deepspeed/x/y.pt"], ignore_patterns=upload["ignore_patterns"])) == []
    )
    push(plan, "acme/tiny-grpo", api=(main := RecordingHub()))
    assert [c[0] for c in main.calls] == ["create_repo", "upload_folder"] and main.calls[1][2]["revision"] is None


def test_a_hub_error_becomes_a_push_error_with_its_message(run_dir):
    plan = plan_push(choose_checkpoint(run_dir))
    request = httpx2.Request("POST", "https://huggingface.co/api/repos/create")
    refused = HfHubHTTPError("401 Unauthorized: invalid token", response=httpx2.Response(401, request=request))
    with pytest.raises(PushError, match=r"upload to acme/x failed: HfHubHTTPError: 401 Unauthorized: invalid token"):
        push(plan, "acme/x", api=RecordingHub(refused))
    with pytest.raises(PushError, match=r"upload to acme/x failed: ConnectError: connection refused"):
        push(plan, "acme/x", api=RecordingHub(httpx2.ConnectError("connection refused", request=request)))


def test_cli_dry_run_prints_the_files_and_card_and_uploads_nothing(run_dir, tmp_path):
    code, out, err, _ = run_cli(
        ["push", str(run_dir), "--repo", "acme/tiny-grpo", "--dry-run", "--step", "3"],
        tmp_path,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert code == 0, err
    assert f"checkpoint: {run_dir / 'checkpoints' / 'step_0003'}" in out
    assert "model.safetensors" in out and "README.md" in out and "optimizer" not in out and "deepspeed" not in out
    assert '"base_model": "tiny-qwen3"' in out and "dry run: nothing uploaded to acme/tiny-grpo" in out
    code, _, err, _ = run_cli(["push", str(run_dir), "--repo", "acme/x", "--step", "1"], tmp_path)
    assert code == 2 and "step 1 was pruned" in err and "available steps: 2, 3" in err


def test_cli_push_without_a_reachable_hub_exits_1_with_the_cause(run_dir, tmp_path):
    """The real HfApi against an endpoint where nothing listens: a clear error, no traceback."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_test", "HF_HOME": str(tmp_path / "hf")}
    for offline, cause in (("0", "ConnectError"), ("1", "OfflineModeIsEnabled")):
        code, out, err, _ = run_cli(
            ["push", str(run_dir), "--repo", "acme/x"], tmp_path, env={**env, "HF_HUB_OFFLINE": offline}, timeout=120
        )
        assert code == 1, (out, err)
        assert f"error: upload to acme/x failed: {cause}" in err and "Traceback" not in err
    env = {"HF_HOME": str(tmp_path / "hf-no-login"), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0"}
    code, out, err, _ = run_cli(["push", str(run_dir), "--repo", "acme/x"], tmp_path, env=env, timeout=120)
    assert code == 1 and "error: no Hugging Face token: set HF_TOKEN" in err, (out, err)


# --- data.format: hub ------------------------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_hub_dataset(hf_home: Path, repo_id: str, configs: dict[str, dict[str, list[dict]]]) -> None:
    """Leave `repo_id` in HF_HOME's datasets cache as a load with network does: each config's splits prepared by
    the builder of its data files (json) under <namespace>___<name>/<config>/0.0.0/<commit>/."""
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo_id.split("/")
    files, build = hf_home / "files", hf_home / "build"
    for config, splits in configs.items():
        data_files = {}
        for split, rows in splits.items():
            path = files / config / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            data_files[split] = str(path)
        Json(
            cache_dir=str(build),
            dataset_name=name,
            config_name=config,
            config_id=config,
            hash=COMMIT,
            data_files=data_files,
        ).download_and_prepare()
    (hf_home / "datasets").mkdir(parents=True)
    shutil.move(build / name, hf_home / "datasets" / f"{namespace}___{name}")


def _load_offline(hf_home: Path, *args) -> dict:
    """refiner_core.data.sources.load_rows (rows or error) and the preflight's check of the same source (problems), in
    a process with no network and the cache under `hf_home`."""
    script = (
        "import json, sys\nfrom refiner_core.data.sources import SourceError, load_rows\n"
        "from refiner_core.config import CHAT_FIELDS, REFINER_FIELDS\n"
        "from refiner_core.preflight import check_source\n"
        "path, fmt, fields, split, config = json.loads(sys.argv[1])\n"
        "out = {'problems': check_source('data', path, fmt, fields or {}, split, REFINER_FIELDS + CHAT_FIELDS,"
        " shape=True, hub_config=config)}\n"
        "try:\n    rows = load_rows(path, fmt, fields, split, config)\n"
        "    out.update(rows=[r.data for r in rows], refs=[r.row_ref for r in rows])\n"
        "except SourceError as e:\n    out['error'] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("HF_DATASETS_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_cached_hub_dataset_loads_offline_with_its_config_and_split(tmp_path):
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines()[:4]]
    for r in rows:  # uniform column types: rubric lists as JSON text
        for key in ("positive_rubrics", "negative_rubrics"):
            r[key] = json.dumps(r[key])
    renamed = [{("prompt" if k == "question" else k): v for k, v in r.items()} for r in rows[3:]]
    hf_home = tmp_path / "hf"
    _cache_hub_dataset(
        hf_home, "acme/refiner-rows", {"main": {"train": rows[:2], "test": rows[2:3]}, "renamed": {"train": renamed}}
    )
    got = _load_offline(hf_home, "acme/refiner-rows", "hub", None, "train", "main")
    assert got["rows"] == rows[:2] and got["refs"] == ["row 0", "row 1"] and got["problems"] == []
    assert _load_offline(hf_home, "acme/refiner-rows", "hub", None, "test", "main")["rows"] == rows[2:3]
    got = _load_offline(hf_home, "acme/refiner-rows", "hub", {"question": "prompt"}, "train", "renamed")
    assert got["rows"] == [{**renamed[0], "question": rows[3]["question"]}]  # the mapped column reads as question
    assert got["problems"] == []
    problems = _load_offline(hf_home, "acme/refiner-rows", "hub", {"question": "prompt"}, "train", "main")["problems"]
    assert problems == [
        "data.fields: question -> 'prompt': no such column in acme/refiner-rows; its columns: id, "
        "question, reasoning, tool_output, answer, supporting_ids, positive_rubrics, negative_rubrics"
    ]
    got = _load_offline(hf_home, "acme/refiner-rows", "hub", None, "validation", "main")
    assert "split 'validation'" in got["error"] and "['train', 'test']" in got["error"]
    assert got["problems"] == [
        "data.path: hub dataset 'acme/refiner-rows' (config 'main'): no split 'validation'; "
        "available: ['train', 'test']"
    ]
    got = _load_offline(hf_home, "acme/refiner-rows", "hub", None, "train", "other")
    assert "config 'other'" in got["error"] and "['main', 'renamed']" in got["error"]
    assert len(got["problems"]) == 1 and "config 'other'" in got["problems"][0]


def test_a_hub_dataset_missing_from_the_cache_says_so_without_network(tmp_path):
    got = _load_offline(tmp_path / "hf", "acme/absent", "hub", None, "train", "")
    assert "hub dataset 'acme/absent' is not in the local cache" in got["error"] and "no network" in got["error"]
    assert str(tmp_path / "hf" / "datasets") in got["error"]
    assert got["problems"] == [f"data.path: {got['error']}"]  # the run stops before any stage
