"""Publishing a checkpoint folder of a run to the Hugging Face Hub: which checkpoint, what it must hold, which of
its files go up (never the optimizer state), and the two Hub calls that upload them. An adapter-only LoRA
checkpoint goes up as the run's policy: its adapter merged into its base, in a temporary folder; a LoRA checkpoint
with merged weights (model.lora_save_merged) sends those alone, not its adapter/, whose base is a local folder.

The Hub client is passed in (`huggingface_hub.HfApi()` by default), so everything before the upload runs offline.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from refiner_core.models import ADAPTER_DIR, checkpoint_adapter, load_model, merge_dtype
from refiner_core.publish.model_card import MODEL_CARD
from refiner_core.store.checkpoints import TRAINING_STATE_FILES, pruned_paths, step_checkpoints

CHECKPOINTS = "checkpoints"
SFT_CHECKPOINT = "sft"
TEACHER_CHECKPOINTS = "teacher"  # the EMA teacher's step checkpoints (Co-rewarding-II)
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what PEFT writes into an adapter folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them, beside tokenizer_config.json


class PushError(RuntimeError):
    pass


@dataclass(frozen=True)
class PushPlan:
    folder: Path  # the checkpoint
    files: list[tuple[str, int]]  # (path relative to `source`, bytes), uploaded in this order
    card_metadata: dict
    # an adapter-only LoRA checkpoint's merged copy (_merged_copy), removed with the plan
    staged: tempfile.TemporaryDirectory | None = field(default=None, repr=False, compare=False)

    @property
    def source(self) -> Path:
        """The folder the upload reads: the checkpoint, or its merged copy."""
        return Path(self.staged.name) if self.staged is not None else self.folder

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def choose_checkpoint(run_dir: Path, step: int | None = None, sft: bool = False, teacher: bool = False) -> Path:
    """The checkpoint folder to publish: the SFT one, step `step`, or else the newest step checkpoint; of the
    policy, or with `teacher` of the EMA teacher (RUN_DIR/teacher/step_NNNN)."""
    folder = Path(run_dir) / (TEACHER_CHECKPOINTS if teacher else CHECKPOINTS)
    if sft and teacher:
        raise PushError("--sft and --teacher exclude each other: the teacher has no SFT checkpoint")
    if sft:
        if not (folder / SFT_CHECKPOINT).is_dir():
            raise PushError(f"{run_dir} has no SFT checkpoint ({folder / SFT_CHECKPOINT})")
        return folder / SFT_CHECKPOINT
    steps = step_checkpoints(folder)
    available = ", ".join(str(s) for s in sorted(steps)) or "none"
    if step is None:
        if not steps:
            raise PushError(f"{run_dir} has no {'teacher' if teacher else 'step'} checkpoints in {folder}")
        return steps[max(steps)]
    if step in steps:
        return steps[step]
    pruned = {Path(p).name for p in pruned_paths(folder)}  # by name: the list holds the paths the run used
    why = "was pruned (run.keep_last / run.keep_every)" if f"step_{step:04d}" in pruned else "does not exist"
    raise PushError(f"checkpoint of step {step} {why}; available steps: {available}")


def plan_push(folder: Path) -> PushPlan:
    """Check that `folder` is a complete checkpoint and list the files to upload: all but the training state and a
    LoRA adapter/; for an adapter-only LoRA checkpoint, those of its merged copy (_merged_copy)."""
    from huggingface_hub import ModelCard

    folder = Path(folder)
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    missing = [
        what
        for what, present in (
            ("config.json", "config.json" in names),
            (
                f"weights ({' or '.join(WEIGHT_PATTERNS)}, or a LoRA {ADAPTER_DIR}/{ADAPTER_WEIGHTS})",
                any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS)
                or (folder / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file(),
            ),
            ("tokenizer_config.json", "tokenizer_config.json" in names),
            (f"a tokenizer ({' or '.join(TOKENIZER_FILES)})", bool(names & set(TOKENIZER_FILES))),
            (f"the model card {MODEL_CARD}", MODEL_CARD in names),
        )
        if not present
    ]
    if missing:
        raise PushError(f"{folder} is not a complete checkpoint: missing {', '.join(missing)}")
    try:
        metadata = ModelCard.load(folder / MODEL_CARD).data.to_dict()
    except (ValueError, yaml.YAMLError) as e:
        raise PushError(f"{folder / MODEL_CARD}: not a parseable model card: {' '.join(str(e).split())}") from None
    if not metadata:
        raise PushError(f"{folder / MODEL_CARD}: the model card has no metadata block (---, YAML, ---)")
    staged = _merged_copy(folder) if checkpoint_adapter(folder) is not None else None
    source = Path(staged.name) if staged is not None else folder
    files = sorted(
        (p.relative_to(source).as_posix(), p.stat().st_size)
        for p in source.rglob("*")
        if p.is_file() and p.relative_to(source).parts[0] not in (*TRAINING_STATE_FILES, ADAPTER_DIR)
    )
    return PushPlan(folder, files, metadata, staged)


def _merged_copy(folder: Path) -> tempfile.TemporaryDirectory:
    """An adapter-only LoRA checkpoint as the run's engines loaded it: the adapter merged into its base, in the
    dtype the learner merged in, beside the checkpoint's tokenizer and card; no adapter/. Its base is no model a
    reader of the Hub has (the run's SFT checkpoint, a local folder, a model built or converted here), so the
    adapter alone would not sample as the policy did."""
    try:
        model = load_model(folder, merge_dtype(folder), device="cpu")
    except FileNotFoundError as e:  # its base is gone
        raise PushError(f"{folder}: {e}") from None
    staged = tempfile.TemporaryDirectory(prefix="refiner-push-")
    model.save_pretrained(staged.name)  # config.json and generation_config.json too
    for path in folder.iterdir():
        kept = Path(staged.name) / path.name
        if path.is_file() and path.name not in TRAINING_STATE_FILES and not kept.exists():
            shutil.copy2(path, kept)
    return staged


def push(plan: PushPlan, repo_id: str, *, private: bool = False, revision: str | None = None, api=None) -> str:
    """Create the repo (kept when it exists), the branch `revision` when named, and upload the plan's files.
    Returns the commit's URL. Hub errors (no token, no network, refused) become a PushError."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HTTPError

    if api is None:
        if get_token() is None:  # the Hub would answer 401 only after the repo creation request
            raise PushError("no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
        api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            folder_path=plan.source,
            repo_id=repo_id,
            revision=revision,
            allow_patterns=[name for name, _ in plan.files],
            # a training-state file written after the plan was made still stays local
            ignore_patterns=[p for name in TRAINING_STATE_FILES for p in (name, f"{name}/*")],
            commit_message=f"Upload {plan.folder.parent.name}/{plan.folder.name}",
        )
    except (OSError, HTTPError) as e:  # HfHubHTTPError and the missing-token error are OSErrors too
        raise PushError(f"upload to {repo_id} failed: {type(e).__name__}: {' '.join(str(e).split())}") from None
    return str(getattr(commit, "commit_url", commit))
