"""What models and weights are known by: a checkpoint folder's model identity (architecture, generation config,
tokenizer: engines and learners built from folders that agree here can take each other's weights) and a state
dict's content hash (the name of weights never written to a checkpoint, run.save_every)."""

from __future__ import annotations

import json
from pathlib import Path

from refiner_core.store.storage import file_hash, json_hash

# The files of a checkpoint folder that make the model what it is, weights aside: the architecture, generation
# config and tokenizer (not a model card or training state, which change every step).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


# Keys that record where and with which library version a file was saved, not what the model is.
SAVE_NOTES = ("transformers_version", "_name_or_path", "name_or_path", "is_local", "local_files_only")


def model_identity(model_path: str | Path) -> str:
    """The architecture, generation config and tokenizer of a checkpoint folder: engines built from folders that
    agree here can take each other's weights. JSON files count by content, less the save notes (a tokenizer saved
    again records that it was loaded from a local folder)."""
    root = Path(model_path)
    files = sorted(
        p for p in root.iterdir() if p.is_file() and (p.name in MODEL_FILES or p.name.startswith("tokenizer"))
    )
    return json_hash({p.name: _content(p) for p in files})


def _content(path: Path):
    if path.suffix != ".json" or path.name == "tokenizer.json":  # tokenizer.json: the vocabulary, large
        return file_hash(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if k not in SAVE_NOTES} if isinstance(data, dict) else data


def weights_hash(state_dict: dict) -> str:
    """A content hash of a state dict (names, dtypes, shapes and bytes): what an unsaved policy is known by."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())  # bfloat16 has no numpy dtype
    return f"weights-{digest.hexdigest()}"
