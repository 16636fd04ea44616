"""The import graph of april_ext, read from the source with ast (nothing is imported), against one table of
layers: a module imports only from its own layer and the layers below it; peers (engines and trainers)
import none of each other. Every import counts: one inside a function, under TYPE_CHECKING, or by
importlib.import_module with a literal name, since a lazy import is still a dependency. The README's
Layout section lists the same layers in the same order (checked here too)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "april_ext"
# Shipped as april_ext.triton_kernels (setup.py's package_dir).
KERNELS = REPO / "triton_kernels"
PACKAGE = "april_ext"  # the package's own __init__ (and names it defines, e.g. __version__)


@dataclass(frozen=True)
class Layer:
    name: str
    members: tuple[str, ...]
    peers: bool = False
    """Members import none of each other."""
    only: tuple[str, ...] | None = None
    """Of the layers below, just these members (the bottom of the protocol)."""


# Bottom to top: the one table of the layer order (the README's Layout is checked against it).
LAYERS: tuple[Layer, ...] = (
    Layer("vocabulary", (PACKAGE, "_C", "errors", "deprecation", "batch", "data_source", "persistence", "settings",
                         "scheduler", "strategies", "plots")),
    Layer("protocol", ("protocol",), only=("errors", "batch", "data_source")),
    Layer("components", ("memory", "model", "algorithms", "data", "tasks", "triton_kernels")),
    Layer("weight sync", ("weights",)),
    Layer("rollout loop", ("rollout",)),
    Layer("engines and trainers", ("engine", "sim", "sglang", "trainer"), peers=True),
    Layer("server", ("server",)),
    Layer("training run", ("training",)),
    Layer("cluster", ("cluster",)),
    Layer("command line", ("cli",)),
)
LAYER_OF = {member: i for i, layer in enumerate(LAYERS) for member in layer.members}


def _module_name(path: Path) -> str:
    if path.is_relative_to(KERNELS):
        parts = ["april_ext", "triton_kernels", *path.relative_to(KERNELS).with_suffix("").parts]
    else:
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every april_ext import in the file: statements anywhere, and
    importlib.import_module / __import__ calls and module-path strings in lists like cli.COMMANDS."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from april_ext import engine` imports the package april_ext.engine.
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # A dotted module path in a string is an import by name (importlib, a registry of commands).
            if re.fullmatch(r"april_ext(\.\w+)+", node.value):
                found.append((node.lineno, node.value))
    return [(line, target) for line, target in found if target == "april_ext" or target.startswith("april_ext.")]


def layer_member(module: str) -> str:
    parts = module.split(".")
    if parts[-1] == "__main__":
        # A package's __main__ is a program run by `python -m` that nothing imports: the command line, wherever it
        # sits (python -m april_ext.server runs `april-ext serve`).
        return "cli"
    if len(parts) == 1 or parts[1] not in LAYER_OF:
        return PACKAGE
    return parts[1]


def source_files() -> list[Path]:
    return sorted(ROOT.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))


def violation(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target``, or None."""
    a, b = layer_member(source), layer_member(target)
    if a == b:
        return None
    la, lb = LAYER_OF[a], LAYER_OF[b]
    layer = LAYERS[la]
    if lb > la:
        return f"{a} ({layer.name}) is below {b} ({LAYERS[lb].name})"
    if lb == la and layer.peers:
        return f"{a} and {b} are peers ({layer.name}): neither imports the other"
    if lb < la and layer.only is not None and b not in layer.only:
        return f"{a} may import only {list(layer.only)} of the layers below it"
    return None


def violations(files: list[Path], sources: dict[Path, str] | None = None) -> list[str]:
    out = []
    for path in files:
        module = _module_name(path)
        for line, target in imports(path, (sources or {}).get(path)):
            if (why := violation(module, target)) is not None:
                out.append(f"{path.relative_to(REPO)}:{line} imports {target}: {why}")
    return out


def test_every_module_belongs_to_a_layer() -> None:
    top = {p.parts[0] if len(p.parts) > 1 else p.stem
           for p in (q.relative_to(ROOT) for q in ROOT.rglob("*.py")) if p.name != "__init__.py" or len(p.parts) > 1}
    top |= {p.name.split(".")[0] for p in ROOT.glob("_C*.so")}
    assert top - set(LAYER_OF) == set(), "add these modules to LAYERS (and the README's Layout)"


def test_the_import_graph_follows_the_layers() -> None:
    files = source_files()
    assert any(_module_name(p).startswith("april_ext.triton_kernels.") for p in files)
    assert len(files) > 100
    found = violations(files)
    assert not found, "imports against the layer order:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("statement, why", [
    ("from april_ext.cluster import RayTopologyRun", "training (training run) is below cluster (cluster)"),
    ("def f():\n    from april_ext.cluster import topology_run\n", "below cluster"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import april_ext.cli\n", "below cli"),
    ("import importlib\nimportlib.import_module('april_ext.cluster.session')\n", "below cluster"),
    ("from ..engine import AsyncEngine\n", None),
])
def test_a_planted_up_import_fails_with_its_file_and_line(statement: str, why: str | None) -> None:
    path = ROOT / "training" / "run.py"
    original = path.read_text()
    planted = original + "\n" + statement
    offset = next(i for i, text in enumerate(statement.splitlines()) if "april_ext" in text or "engine" in text)
    line = original.count("\n") + 2 + offset
    found = violations([path], {path: planted})
    if why is None:  # training may import an engine: it sits above them
        assert found == []
        return
    assert len(found) == 1 and why in found[0], found
    assert found[0].startswith(f"april_ext/training/run.py:{line} "), found


def module_graph(files: list[Path]) -> dict[str, set[str]]:
    """Each module's april_ext imports, as modules: ``from pkg import name`` is pkg.name when that is a module;
    packages' __init__ files (their re-exports) are left out."""
    names = {_module_name(p): p for p in files}
    packages = {m for m, p in names.items() if p.name == "__init__.py"}
    graph = {}
    for module, path in names.items():
        if module in packages:
            continue
        targets = set()
        for _, target in imports(path):
            while target not in names and "." in target:
                target = target.rsplit(".", 1)[0]
            if target not in packages and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def test_no_modules_import_each_other() -> None:
    """No import cycle among modules, direct or through others (cluster's trainer group and its weight broadcast
    once called into each other)."""
    graph = module_graph(source_files())
    cycles = []
    for start in graph:
        path, seen = [start], {start}
        stack = [iter(graph[start])]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                stack.pop()
                path.pop()
            elif target == start:
                cycles.append(" -> ".join([*path, start]))
            elif target not in seen and target in graph:
                seen.add(target)
                path.append(target)
                stack.append(iter(graph[target]))
    assert not cycles, "import cycles:\n  " + "\n  ".join(sorted(cycles))


def test_peer_and_protocol_rules() -> None:
    assert violation("april_ext.engine.core", "april_ext.sglang.client") is not None
    assert violation("april_ext.trainer.torch_trainer", "april_ext.sim.runner") is not None
    assert violation("april_ext.protocol.outputs", "april_ext.scheduler") is not None
    assert violation("april_ext.protocol.outputs", "april_ext.errors") is None
    assert violation("april_ext.server.app", "april_ext.engine") is None
    assert violation("april_ext.server.__main__", "april_ext.cli.serve") is None
    assert violation("april_ext.server.foreground", "april_ext.cli.serve") is not None


@pytest.mark.parametrize("target", ["april_ext.sglang.workers", "april_ext.cluster.trainer_ranks",
                                    "april_ext.trainer.torch_trainer", "april_ext.engine", "april_ext.training.config"])
def test_weight_sync_imports_no_engine_trainer_or_cluster(target: str) -> None:
    """Weight sync reads one way: engines, trainers and the cluster import april_ext.weights, never the reverse."""
    assert violation("april_ext.weights.transport", target) is not None
    assert violation(target, "april_ext.weights.transport") is None


def _layout_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("april_ext/"))
    return [line for line in lines[start + 1:] if line.startswith("  ") and not line.startswith("   ")]


def test_the_readmes_layout_lists_the_layers_in_order() -> None:
    """Each layer's members are on the Layout lines (as name/ or name.py), every layer's before the next's."""
    lines = _layout_lines()
    last = -1
    for layer in LAYERS:
        where = []
        for member in layer.members:
            if member in (PACKAGE, "_C"):
                continue
            hits = [i for i, line in enumerate(lines) if re.search(rf"(^|[\s,]){member}(/|\.py)", line)]
            assert hits, f"the README's Layout does not list {member} ({layer.name})"
            where.append(hits[0])
        assert min(where) > last, f"the README's Layout lists {layer.name} before a layer below it"
        last = max(where)
