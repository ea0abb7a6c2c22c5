"""The shape of refiner_core: its packages and top-level modules in layers, each importing only layers below it (imports
inside functions count), hence no import cycle; storage I/O knows nothing of rewards, and the NumPy/DuckDB paths
(rescore, the catalog) load no torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "refiner_core"


# Bottom to top: a package (or top-level module) may import only those before it.
LAYERS = [
    "refiner_core",
    "peer_names",
    "config",
    "stage_settings",
    "schema",
    "algo",
    "store",
    "data",
    "models",
    "runtime",
    "learners",
    "rollout",
    "rubrics",
    "judges",
    "reward",
    "eval",
    "agent",
    "sft",
    "grpo",
    "publish",
    "preflight",
]


REGISTRY_ENTRY = re.compile(r"^refiner_core(\.\w+)+:\w+$")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(registry_edges: bool = False) -> dict[str, set[str]]:
    """refiner_core module -> the refiner_core modules it imports anywhere in its source (a package's own
    __init__ counts as a module). With `registry_edges`, a backend table's "module:factory" string counts as an
    import of that module (it is imported when chosen), though a table and its backends import each other."""
    modules = {_module_name(p): p for p in CORE.rglob("*.py")}

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {resolve(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {resolve(f"{node.module}.{alias.name}") or resolve(node.module) for alias in node.names}
            elif registry_edges and isinstance(node, ast.Constant) and REGISTRY_ENTRY.match(str(node.value)):
                targets.add(resolve(node.value.partition(":")[0]))  # a backend table's "module:factory": an import
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_refiner_core_has_no_import_cycle():
    graph = import_graph()
    assert "refiner_core.data.rubric_fields" in graph and graph["refiner_core.rubrics.join"] >= {
        "refiner_core.data.rubric_fields"
    }
    assert cycles(graph) == []


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_package_imports_only_the_layers_below_it():
    graph = import_graph(registry_edges=True)
    assert "refiner_core.reward.tcr" in graph["refiner_core.reward.verifiers"], "registry strings are edges"
    assert {layer(m) for m in graph} == set(LAYERS), "a new package or top-level module needs its place in LAYERS"
    upward = sorted(
        (m, t) for m, targets in graph.items() for t in targets if LAYERS.index(layer(t)) > LAYERS.index(layer(m))
    )
    assert upward == []


def test_storage_io_knows_nothing_of_rewards_or_the_catalog():
    graph = import_graph()
    assert not graph["refiner_core.store.storage"] & {"refiner_core.reward.compose", "refiner_core.publish.catalog"}
    assert not graph["refiner_core.data.rubric_fields"] & {"refiner_core.data.rows", "refiner_core.rubrics.generate"}


@pytest.mark.parametrize(
    "module", ["refiner_core.reward.rescore", "refiner_core.publish.catalog", "refiner_core.algo.advantages"]
)
def test_numpy_and_duckdb_paths_load_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def config_dict_parameters(source: str) -> list[str]:
    """Function parameters that take a recipe section as a dict: named *_cfg, or annotated `dict` and named cfg,
    config, settings or after a section (model and data name manifests: a checkpoint's path and hash, a stage's
    statistics)."""
    sections = {"cfg", "config", "settings", "rubrics", "sft", "rollout", "agent", "judge", "reward", "grpo", "eval"}
    sections.add("lora")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                if arg.arg.endswith("_cfg") or (arg.arg in sections and annotation.split(" |")[0] == "dict"):
                    found.append(f"{node.name}({arg.arg}: {annotation or '?'})")
    return found


def test_the_dict_parameter_finder_finds_one():
    assert config_dict_parameters("def f(a, rollout_cfg, *, settings: dict | None = None, row: dict): ...") == [
        "f(rollout_cfg: ?)",
        "f(settings: dict | None)",
    ]


def test_the_core_takes_recipe_sections_as_dataclasses():
    """Stages receive their sections as dicts (their cache keys hash them) and hand refiner_core the section's
    dataclass, so the core reads a documented field, never a key with a repeated default. refiner_core.config is
    where dicts become sections."""
    found = {
        str(path.relative_to(REPO)): names
        for path in sorted(CORE.rglob("*.py"))
        if path != CORE / "config.py" and (names := config_dict_parameters(path.read_text(encoding="utf-8")))
    }
    assert found == {}
