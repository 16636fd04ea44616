"""The import graph of april_ext, read from the source with ast (nothing is imported): the layers that must
not depend on each other do not. Every import statement counts, also one inside a function or under
TYPE_CHECKING, since a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "april_ext"

# (importing package, imported packages it must not import, why)
FORBIDDEN: list[tuple[str, tuple[str, ...], str]] = [
    ("engine", ("sim", "sglang", "server", "training", "cluster"),
     "an engine imports no other engine, no server, no training"),
    ("sim", ("engine", "sglang", "server", "training", "cluster"),
     "an engine imports no other engine, no server, no training"),
    ("sglang", ("engine", "sim", "server", "training", "cluster"),
     "an engine imports no other engine, no server, no training"),
    ("rollout", ("tasks", "engine", "sim", "sglang", "cluster"), "the loop speaks the protocol, not a concrete engine"),
    ("trainer", ("engine", "sim", "sglang", "server", "rollout", "cluster"), "trainers know no engine and no loop"),
    ("model", ("engine", "trainer", "rollout", "server", "sglang", "sim", "training", "cluster"),
     "the model is below everything that uses it"),
    ("server", ("training", "cluster"), "a server serves an engine; it knows no run"),
    # cluster is the top layer beside training (whose run enters it when TrainConfig.ray is set).
    ("cluster", ("engine", "sim", "server"), "the Ray layer starts engines as servers and talks to them over HTTP"),
]
# april_ext.protocol is the bottom layer: of april_ext it imports only these (and itself).
PROTOCOL_ALLOWED = ("protocol", "errors", "batch", "data_source")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every april_ext import in the file."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
    return [(line, target) for line, target in found if target == "april_ext" or target.startswith("april_ext.")]


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _edges() -> list[tuple[str, int, str]]:
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        source = _module_name(path)
        edges += [(source, line, target) for line, target in _imports(path)]
    return edges


def test_the_source_tree_is_found_and_parsed() -> None:
    edges = _edges()
    assert any(s.startswith("april_ext.engine.") and t.startswith("april_ext.protocol") for s, _, t in edges)
    assert any(s.startswith("april_ext.sglang.") and t.startswith("april_ext.protocol") for s, _, t in edges)


def _violations(allowed_only: tuple[str, ...] | None, layer: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for source, line, target in _edges():
        if _layer(source) != layer:
            continue
        imported = _layer(target)
        bad = imported not in allowed_only if allowed_only is not None else imported in forbidden
        if bad:
            out.append(f"{source} (line {line}) imports {target}")
    return out


@pytest.mark.parametrize("layer, forbidden, why", FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
def test_forbidden_imports_are_absent(layer: str, forbidden: tuple[str, ...], why: str) -> None:
    violations = _violations(None, layer, forbidden)
    assert not violations, f"{why}:\n  " + "\n  ".join(violations)


def test_protocol_imports_only_the_bottom_of_april_ext() -> None:
    violations = _violations(PROTOCOL_ALLOWED, "protocol", ())
    assert not violations, (f"april_ext.protocol may import only {list(PROTOCOL_ALLOWED[1:])} of april_ext:\n  "
                            + "\n  ".join(violations))
