"""Shared fixtures: an isolated REFINER_HOME (removed at exit) and Prefect server per session, one thread, the tiny
model."""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest


def _shared_models() -> Path:
    """The models folder of the run's pytest processes: xdist's workers are children of its controller, so they
    share one, and SmolLM2's conversion from the wheel's GGUF (~24 s, 0.5 GB) runs once per suite, not once per
    worker. The controller empties it as it starts (a folder of a process before it with the same ID) and
    removes it as it exits."""
    worker = "PYTEST_XDIST_WORKER" in os.environ
    folder = Path(tempfile.gettempdir()) / f"refiner-test-models-{os.getppid() if worker else os.getpid()}"
    if not worker:
        shutil.rmtree(folder, ignore_errors=True)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    folder.mkdir(exist_ok=True)
    return folder


_SESSION_HOME = Path(tempfile.mkdtemp(prefix="refiner-test-home-"))
atexit.register(shutil.rmtree, _SESSION_HOME, ignore_errors=True)  # the link to the shared models, not them
(_SESSION_HOME / "models").symlink_to(_shared_models(), target_is_directory=True)
# Set before anything imports prefect: results/cache records and models live in this session's home.
os.environ["REFINER_HOME"] = str(_SESSION_HOME)
os.environ["PREFECT_HOME"] = str(_SESSION_HOME / "prefect")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_SESSION_HOME / "prefect-results")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU in the test environment: no accelerator probing
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_SESSION_HOME / "inductor"))
# vLLM's engine sockets (one file per engine, never removed by vLLM): in the session's home, not /tmp. Runs put
# theirs in their own temporary folder; this is for engines tests build outside a run.
(_SESSION_HOME / "vllm-ipc").mkdir()
os.environ.setdefault("VLLM_RPC_BASE_PATH", str(_SESSION_HOME / "vllm-ipc"))
# As refiner_core.models sets them, but before a test module imports transformers or datasets first: the Hub's
# offline switch is read once, when huggingface_hub is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from refiner_core.runtime.heap import freeze_heap  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


_heap_frozen_at: list = [None]  # the test module whose first test froze the heap


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """As each test module starts (the one before torn down), what is alive is the imported libraries and the
    session's fixtures: kept out of the later full collections, which would walk them all (about a tenth of an
    in-process flow test's time otherwise)."""
    if _heap_frozen_at[0] is not item.module:
        _heap_frozen_at[0] = item.module
        freeze_heap()


@pytest.fixture(scope="session")
def prefect_server():
    """A real temporary Prefect API server (SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def api_env(prefect_server) -> dict:
    """Environment for `refiner run` children that report to the session's server instead of starting a temporary
    one each (10 s of a child's 25 s on the tiny recipe). Tests of the temporary server itself leave it out."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value()}


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from refiner_core.models import build_tiny_qwen3

    return build_tiny_qwen3(max_position_embeddings=2048, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from refiner_core.models import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture
def tiny_recipe() -> dict:
    """The tiny recipe as a dict, for flows run in-process."""
    from refiner_core.config import load_recipe

    return load_recipe(REPO / "recipes" / "tiny.yaml").to_dict()


def sigint_default() -> None:
    """A child's `preexec_fn`: SIGINT back to its default, so that the child's Python turns it into
    KeyboardInterrupt even when the suite runs where SIGINT is ignored (a background job of a script), which
    children would otherwise inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(
    args: list[str], tmp_path: Path, env: dict | None = None, timeout: int = 600
) -> tuple[int, str, str, float]:
    """`refiner ARGS` in a child process (Prefect's logging and server are per process), in its own process group
    so that a temporary Prefect server a hard-killed run leaves behind is reaped. Output goes to files, not pipes:
    such a leftover would hold a pipe open. The child keeps to one thread: its worker waits on it while the other
    workers run beside it, and two runs at once at torch's default threads took twice as long
    (bench/parallel_runs.py). Returns (exit code, stdout, stderr, seconds)."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_LOGGING_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    fd, name = tempfile.mkstemp(prefix="cli-", dir=tmp_path)
    os.close(fd)
    out_path, err_path = Path(name + ".out"), Path(name + ".err")
    t0 = time.time()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
            preexec_fn=sigint_default,
        )
        try:
            code = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return code, out_path.read_text(), err_path.read_text(), time.time() - t0


def learner_samples():
    """Eight train samples of the tiny model's vocabulary: prompts of 20-41 tokens, responses of 8-22, advantages of
    both signs and one 0."""
    import torch

    from refiner_core.learners.base import TrainSample

    g = torch.Generator().manual_seed(0)
    return [
        TrainSample(
            torch.randint(3, 2000, (20 + 3 * k,), generator=g).tolist(),
            torch.randint(3, 2000, (8 + 2 * k,), generator=g).tolist(),
            adv,
            [-7.0] * (8 + 2 * k),
        )
        for k, adv in enumerate([1.0, -1.0, 0.5, -0.5, 1.2, -1.2, 0.0, 0.3])
    ]


def learner_settings(temperature: float = 0.7, precision: str = "fp32", **overrides):
    """LearnerSettings for learner tests, from the recipe's GRPO and LoRA fields (their defaults, then these): fp32,
    k3 KL, token-mean, no clipping of the gradient norm, padded batches (no packing, no shared prompts)."""
    from refiner_core.config import DEEPSPEED_FLAT_NAMES, DeepSpeedConfig, GRPOConfig, ModelConfig
    from refiner_core.grpo import LORA_FIELDS
    from refiner_core.grpo import learner_settings as from_recipe

    base = dict(
        learning_rate=1e-2,
        weight_decay=0.0,
        max_grad_norm=0.0,
        beta=0.01,
        kl_estimator="k3",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        loss_aggregation="token_mean",
        loss_constant=64.0,
        micro_batch_size=8,
        minibatches=1,
        tis_cap=0.0,
        pack_length=0,
        share_prompt=False,
    )
    lora = {k: overrides.pop(k) for k in LORA_FIELDS if k in overrides}
    # the deepspeed learner's launch settings by their LearnerSettings names: grpo.deepspeed.*
    deepspeed = {name: overrides.pop(flat) for name, flat in DEEPSPEED_FLAT_NAMES.items() if flat in overrides}
    work_root = overrides.pop("work_root", "")
    grpo = GRPOConfig(**{**base, **overrides}, deepspeed=DeepSpeedConfig(**deepspeed))
    settings = from_recipe(grpo, temperature, precision, ModelConfig(**lora))
    return dataclasses.replace(settings, work_root=work_root) if work_root else settings


def moved_checkpoint(tiny_model_path: Path, folder: Path, seed: int) -> Path:
    """The tiny model with every weight moved (seeded), saved with its tokenizer to `folder`: a run's warm start,
    checkpoints/sft, that LoRA adapters then sit on."""
    import torch

    from refiner_core.models import load_model, load_tokenizer

    model = load_model(tiny_model_path)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(folder)
    load_tokenizer(tiny_model_path).save_pretrained(folder)
    return folder


def math_rows_file(folder: Path, rows: int) -> Path:
    """The first ROWS math training rows (data/math/train.jsonl) as FOLDER/math.jsonl."""
    data = folder / "math.jsonl"
    data.write_text("".join((REPO / "data/math/train.jsonl").read_text().splitlines(keepends=True)[:rows]))
    return data


def catalog_rows(run_dir: Path, sql: str) -> list[tuple]:
    """Rows of a query on a run's catalog, opened read-only."""
    from refiner_core.store.storage import query

    return query(run_dir / "catalog.duckdb", sql)[1]


def sampling_gaps(
    model,
    prompts,
    gens,
    temperature: float,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    top_p: float = 1.0,
    top_p_first: bool = False,
):
    """For generations sampled with top_k, min_p, top_p or a repetition penalty: (tokens sampled outside the
    truncated distribution, max |engine log-prob - the token's log-prob under the processed distribution|),
    computed from the model's logits in vLLM's order: each token already in the prompt or the response so far has
    its logit divided by the penalty (multiplied where negative), then the temperature, then min_p and top_k, then
    top_p over what they kept, renormalised over the kept tokens. `top_p_first`: top_p before min_p (transformers'
    own order)."""
    outside, gap = 0, 0.0
    for g in gens:
        prompt = prompts[g.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        for t in range(len(g.token_ids)):
            seen = torch.tensor(sorted(set(prompt + g.token_ids[:t])))
            row = logits[t, seen]
            logits[t, seen] = torch.where(row < 0, row * repetition_penalty, row / repetition_penalty)
        logp = torch.log_softmax(logits / temperature, -1)
        keep = torch.ones_like(logp, dtype=torch.bool)
        if top_p < 1.0 and top_p_first:
            keep &= _nucleus(logp, top_p)
        if top_k:
            keep &= logp >= logp.topk(top_k, -1).values[:, -1:]
        if min_p:
            keep &= logp >= logp.max(-1, keepdim=True).values + math.log(min_p)
        if top_p < 1.0 and not top_p_first:
            keep &= _nucleus(torch.log_softmax(logp.masked_fill(~keep, -math.inf), -1), top_p)
        tokens = torch.tensor(g.token_ids)[:, None]
        outside += int((~keep.gather(-1, tokens)).sum())
        kept = logp.gather(-1, tokens).squeeze(-1) - torch.logsumexp(logp.masked_fill(~keep, -math.inf), -1)
        gap = max(gap, (kept - torch.tensor(g.logprobs)).abs().max().item())
    return outside, gap


def _nucleus(logp, top_p: float):
    """The tokens of the smallest most-likely set whose probability reaches top_p (per row)."""
    probs = logp.exp()
    ordered, order = probs.sort(-1, descending=True)
    before = ordered.cumsum(-1) - ordered  # the mass of the likelier tokens
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p)


def vllm_logprob_gap(
    model_path,
    weights,
    scorer,
    prompts: list[list[int]],
    params,
    pad_id: int,
    precision: str = "fp32",
    adapter_rank: int = 0,
):
    """|learner - vLLM| log-probs of the tokens a vllm engine given `weights` samples: `scorer` (a model) scores
    them under the same temperature and `precision`. Returns the gaps over the sampled tokens."""
    import torch

    from refiner_core.config import EngineSettings
    from refiner_core.learners.base import TrainSample
    from refiner_core.learners.batching import collate
    from refiner_core.learners.logprobs import token_logprobs
    from refiner_core.rollout.vllm_engine import make_vllm_engine

    settings = EngineSettings.of(engine="vllm", batch_size=16, adapter_rank=adapter_rank)
    engine = make_vllm_engine(str(model_path), settings, "float32", precision, progress=False)
    try:
        engine.load_weights(weights)
        gens = engine.generate(prompts, params)
    finally:
        engine.close()
    batch = collate([TrainSample(prompts[g.prompt_index], g.token_ids, 0.0, g.logprobs) for g in gens], pad_id)
    with torch.no_grad():
        ours = token_logprobs(scorer, batch, params.temperature, precision)
    mask = batch["mask"].bool()
    return (ours[mask] - batch["rollout_logprobs"][mask]).abs()


@pytest.fixture
def info_logs():
    """Prefect's run loggers at INFO (the test session runs them at WARNING): the stages' lines reach the run log."""
    import logging

    import flows.refiner  # noqa: F401  (its imports configure Prefect's logging, which would undo the level)

    logger = logging.getLogger("prefect")
    level = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(level)


# What makes a GPU recipe (vLLM, DeepSpeed, a 4B model) run on the tiny model on CPU; tests add their budgets.
TINY_ON_CPU = [
    "model.policy=tiny-qwen3",
    "model.dtype=float32",
    "model.max_position_embeddings=2048",
    "rollout.engine=hf",
    "grpo.learner=torch",
    "grpo.deepspeed.world_size=1",
]

# The tables a run writes step by step, compared row for row between runs that must agree (kills, forks).
RUN_TABLES = ("prompts", "rubrics", "rollouts", "judge_scores", "reward_inputs", "rewards", "advantages", "steps")


def table_key(table: str) -> str:
    """A table's key as SQL columns, without `run`: its rows in a stable order."""
    from refiner_core.schema import ALL_TABLES

    return ", ".join(c for c in ALL_TABLES[table].key if c != "run")


def vllm_prompt_logprobs(engine, token_ids: list[int]) -> list[float]:
    """A vllm engine's log-prob of each token of `token_ids` given the ones before it (fixed tokens, no sampling)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    out = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=token_ids)],
        VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
        use_tqdm=False,
    )
    return [entry[t].logprob for entry, t in zip(out[0].prompt_logprobs[1:], token_ids[1:])]
