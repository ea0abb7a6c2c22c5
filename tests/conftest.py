"""Shared fixtures: an isolated REFINER_HOME and Prefect server per session, one thread, the tiny model."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_HOME = Path(tempfile.mkdtemp(prefix="refiner-test-home-"))
# Set before anything imports prefect: results/cache records and models live in this session's home.
os.environ["REFINER_HOME"] = str(_SESSION_HOME)
os.environ["PREFECT_HOME"] = str(_SESSION_HOME / "prefect")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_SESSION_HOME / "prefect-results")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_SESSION_HOME / "inductor"))

import torch  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def prefect_server():
    """A real temporary Prefect API server (SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


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
