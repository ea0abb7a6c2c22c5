from __future__ import annotations

from prefect import task

from refiner_core.models import resolve_model
from refiner_core.store.storage import dir_hash


@task(name="locate-model", cache_policy=None, persist_result=False, retries=1)
def locate_model(spec: str, max_position_embeddings: int, seed: int) -> dict:
    """Resolve a model spec to a local checkpoint (building it once) and hash its contents.

    Not cached on purpose: it is cheap and must notice a deleted or rebuilt model folder."""
    path = resolve_model(spec, max_position_embeddings=max_position_embeddings, seed=seed)
    return {"path": str(path), "hash": dir_hash(path)}
