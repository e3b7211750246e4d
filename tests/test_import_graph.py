"""The dependency spine goes one way: a lower layer never imports a higher one.

Every ``import`` in the package is read from the source (lazy imports inside
functions included), resolved to a kvbridge module and checked against the
layer table below, which is the one docs/ARCHITECTURE.md draws.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "kvbridge"

# Top-level parts of the package, lowest first.  A part may import its own
# modules and those of any lower layer; nothing in a layer may import a
# sibling part of the same layer unless the layer says so.
LAYERS: list[tuple[set[str], bool]] = [
    ({"errors"}, False),
    ({"_waits", "models"}, False),
    ({"layout", "_core", "_ucx"}, False),  # the compiled extensions know no Python layer
    ({"pack", "_pack"}, True),  # the public face and its implementation
    ({"wire", "cache", "router", "handoff"}, False),  # the sans-IO core (+ the handoff driver)
    ({"pdd"}, False),  # the PDD orchestration core over the router and the handoff (+ its driver)
    ({"transport"}, False),
    ({"bridge"}, False),
    ({"integrations"}, False),
    ({"reference", "sim", "testing"}, True),  # engines, workloads, test helpers
    ({"demo", "cli"}, True),  # programs
]

# IO-free parts: no sockets, no event loop, no threads.
SANS_IO = ["wire", "cache", "router", "layout", "pack", "_pack", "handoff.messages", "handoff.relay",
           "handoff.main", "handoff.policy", "handoff.stream", "handoff.outputs",
           "handoff.params", "pdd.core", "pdd.events", "pdd.budget"]  # fmt: skip
IO_MODULES = {"asyncio", "socket", "ssl", "uvloop", "selectors", "concurrent"}

# transports stay independent: importing one never pulls in another's dependencies
FORBIDDEN_PAIRS = [("transport.tcp", "transport.ucx"), ("transport.ucx", "transport.tcp")]


def _layer(part: str) -> int:
    for i, (parts, _) in enumerate(LAYERS):
        if part in parts:
            return i
    raise AssertionError(f"kvbridge.{part} is in no layer of tests/test_import_graph.py")


def _modname(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``."""
    mod = _modname(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # ``from kvbridge.x import y`` may name the submodule y
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return out


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _violations() -> list[str]:
    known = {_modname(p) for p in _modules()} | {"kvbridge._core", "kvbridge._ucx"}
    bad: list[str] = []
    for path in _modules():
        mod = _modname(path)
        if mod == "kvbridge":
            continue  # the facade: lazy re-exports of the public API
        part = mod.split(".")[1]
        src_layer = _layer(part)
        sub = ".".join(mod.split(".")[1:])
        for line, target in _imports(path):
            where = f"{path.relative_to(PKG.parent)}:{line}"
            sans_io = any(sub == s or sub.startswith(s + ".") for s in SANS_IO)
            if sans_io and target.split(".")[0] in IO_MODULES:
                bad.append(f"{where}: sans-IO {mod} imports {target}")
            if not target.startswith("kvbridge.") or target not in known:
                continue
            tpart = target.split(".")[1]
            if tpart == part:
                tsub = ".".join(target.split(".")[1:])
                for a, b in FORBIDDEN_PAIRS:
                    if (sub == a or sub.startswith(a + ".")) and (
                        tsub == b or tsub.startswith(b + ".")
                    ):
                        bad.append(f"{where}: {mod} imports {target} (transports are independent)")
                continue
            tlayer = _layer(tpart)
            if tlayer > src_layer or (tlayer == src_layer and not LAYERS[src_layer][1]):
                bad.append(f"{where}: {mod} (layer {src_layer}) imports {target} (layer {tlayer})")
    return bad


def test_every_part_has_a_layer() -> None:
    for p in PKG.iterdir():
        name = p.stem if p.suffix == ".py" else p.name
        if p.name.startswith("__") or p.suffix in (".so", ".pyi", ".typed"):
            continue
        if p.is_dir() and not (p / "__init__.py").exists():
            continue
        _layer(name)


def test_imports_go_down_only() -> None:
    bad = _violations()
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lower layer that imports a higher one is reported."""
    fake = PKG / "wire" / "_zz_import_graph_probe.py"
    fake.write_text("from ..bridge import PrefillBridge\nimport asyncio\n")
    try:
        bad = _violations()
    finally:
        fake.unlink()
    assert any("_zz_import_graph_probe" in b and "bridge" in b for b in bad)
    assert any("_zz_import_graph_probe" in b and "asyncio" in b for b in bad)
