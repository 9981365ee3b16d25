"""The package layout holds what docs/layout.md says: no import cycles between kvbatch's modules
(counting imports inside functions too, which is where a cycle usually hides), the engine's
public API importable from ``kvbatch.engine``, nothing below ``pipelines/`` and ``resources/``
importing dagster, and no module importing a layer above its own (DESIGN.md: pipelines ->
resources -> ops -> engine, io -> kernels)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "serve", "pipelines", "resources", "ops", "engine", "io", "kernels")
# Layers from the top; a module may import its own layer and those below it. ``serve`` (the
# Files + Batches API) sits above the pipeline it runs batches on.
LAYERS = {"cli": 0, "serve": 1, "pipelines": 2, "resources": 3, "ops": 4, "engine": 5, "io": 5, "kernels": 6}
# The only serve modules that talk to the Dagster instance (start and execute runs).
SERVE_DAGSTER_MODULES = {"serve/worker.py"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "kvbatch." + ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every kvbatch module ``path`` imports, at module level or inside functions, except under
    ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("kvbatch."):
                # the deepest known module the name lies in (an imported attribute is not a module)
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in known:
                    out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    # Importing a module runs its packages' __init__ first: those edges count, except the
    # lazy public-API table of kvbatch.engine (resolved by __getattr__, on first use only).
    return {m: _imports(p, known) - {m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_go_down_the_layers_only():
    upward = [(m, d) for m, deps in _graph().items() for d in deps
              if LAYERS[d.split(".")[1]] < LAYERS[m.split(".")[1]]]
    assert upward == []


def _is_dagster(module: str) -> bool:
    # dagster_pipes is the dependency-free protocol a launched worker speaks back to Dagster
    # with (ops/decode/worker.py under Pipes); it is not the framework and pulls none of it in.
    top = module.split(".")[0]
    return top.startswith("dagster") and top != "dagster_pipes"


@pytest.mark.parametrize("package", ["ops", "engine", "io", "kernels", "cli"])
def test_no_dagster_below_pipelines_and_resources(package):
    offenders = []
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(_is_dagster(a.name) for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and _is_dagster(node.module or ""):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_dagster_in_serve_only_where_it_talks_to_the_instance():
    importers = set()
    for path in (REPO / "serve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(_is_dagster(a.name) for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and _is_dagster(node.module or ""):
                importers.add(str(path.relative_to(REPO)))
    assert importers == SERVE_DAGSTER_MODULES


def test_public_api_from_kvbatch_engine_without_loading_the_engine():
    code = ("import sys, kvbatch.engine as e\n"
            "assert 'torch' not in sys.modules, 'import kvbatch.engine loaded torch'\n"
            "from kvbatch.engine import LLM, GenerationRequest, SamplingParams, EngineConfig\n"
            "from kvbatch.engine.runtime.llm import LLM as L\n"
            "assert LLM is L and sorted(e.__all__) == e.__all__\n"
            "try:\n    e.NoSuchThing\nexcept AttributeError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no attribute 'NoSuchThing'" in out.stdout


def test_dagster_definitions_load_without_torch():
    """Every dagster command and run-worker process imports the definitions; the engine (torch)
    loads only in the steps that run a model."""
    code = "import sys, kvbatch.pipelines.definitions\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_ingest_and_shard_steps_import_without_torch():
    """Ingest and shard tokenize; importing torch would add seconds to every shard process."""
    code = ("import sys, kvbatch.ops.ingest.prompts, kvbatch.ops.shards.build, kvbatch.engine.models.weights\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
