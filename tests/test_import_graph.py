"""The dependency spine goes one way, and the two distributions stay apart.

Every ``import`` in both packages is read from the source (lazy imports
inside functions included) and resolved to an absolute module:

- inside the library (``kvbridge/``), a lower layer never imports a higher
  one (the layer table below is the one docs/ARCHITECTURE.md draws), and the
  library never imports ``kvbridge_bench``;
- the bench (``kvbench/kvbridge_bench/``: the ``kvbridge-bench`` command, the
  demo, the simulation and emulator, the reference engine) uses kvbridge's
  public API only: no module path with a part that starts with ``_``
  (``kvbridge._pack``, ``kvbridge._core``, ...), no imported name that starts
  with ``_``, no name left out of a module's ``__all__``, not even as a string
  handed to ``importlib``;
- the library's wheel holds ``kvbridge`` alone (pyproject's
  ``wheel.packages``), and neither the library nor its dependencies name a
  bench-only one (``tqdm``).
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvbridge"
BENCH = ROOT / "kvbench" / "kvbridge_bench"

# Top-level parts of the library, lowest first.  A part may import its own
# modules and those of any lower layer; nothing in a layer may import a
# sibling part of the same layer unless the layer says so.
LAYERS: list[tuple[set[str], bool]] = [
    ({"errors"}, False),
    ({"_waits", "models"}, False),
    ({"layout", "_core", "_ucx"}, False),  # the compiled extensions know no Python layer
    ({"span"}, False),  # KVSpan: the (block table, tokens, layers, heads) value
    ({"pack", "_pack"}, True),  # the public face and its implementation
    ({"wire", "cache", "router", "handoff"}, False),  # the sans-IO core (+ the handoff driver)
    ({"pdd"}, False),  # the PDD orchestration core over the router and the handoff (+ its driver)
    ({"transport"}, False),
    ({"registry"}, False),  # the fleet registry: records and view (sans-IO), the etcd edge
    ({"fleet"}, False),  # the fleet router core over the registry view, the cache, the router
    ({"bridge"}, False),
    ({"integrations"}, False),
    ({"testing"}, False),  # test helpers (mock stream, torch pack reference, engine caches)
]

# The bench's parts, lowest first (the same rules among themselves).
BENCH_LAYERS: list[tuple[set[str], bool]] = [
    ({"reference", "sim"}, True),  # the reference engine, workloads, the emulator
    ({"demo", "cli", "plan"}, True),  # programs (plan: the fleet simulator)
]

# IO-free parts: no sockets, no event loop, no threads.
SANS_IO = ["wire", "cache", "router", "layout", "span", "pack", "_pack", "handoff.messages", "handoff.relay",
           "handoff.main", "handoff.policy", "handoff.stream", "handoff.outputs",
           "handoff.params", "pdd.core", "pdd.events", "pdd.budget",
           "registry.records", "registry.view", "fleet"]  # fmt: skip
IO_MODULES = {"asyncio", "socket", "ssl", "uvloop", "selectors", "concurrent"}

# transports stay independent: importing one never pulls in another's dependencies
FORBIDDEN_PAIRS = [("transport.tcp", "transport.ucx"), ("transport.ucx", "transport.tcp")]

# what only the bench uses: never a library import, never a library dependency
BENCH_ONLY = {"kvbridge_bench", "tqdm"}


def _layer(layers: list[tuple[set[str], bool]], top: str, part: str) -> int:
    for i, (parts, _) in enumerate(layers):
        if part in parts:
            return i
    raise AssertionError(f"{top}.{part} is in no layer of tests/test_import_graph.py")


def _modname(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(root: Path, path: Path) -> list[tuple[int, str, str | None]]:
    """(line, absolute module, imported name or None) of every import in
    ``path``, and (line, string, None) of every string constant that names
    a kvbridge module (``importlib.import_module("kvbridge.x")``)."""
    mod = _modname(root, path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(node.lineno, target, a.name) for a in node.names]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"kvbridge(\.\w+)+", node.value)
        ):
            out.append((node.lineno, node.value, None))
    return out


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _known(root: Path) -> set[str]:
    return {_modname(root, p) for p in _modules(root)}


def _library_violations(pkg: Path) -> list[str]:
    known = _known(pkg) | {"kvbridge._core", "kvbridge._ucx"}
    bad: list[str] = []
    for path in _modules(pkg):
        mod = _modname(pkg, path)
        if mod == "kvbridge":
            continue  # the facade: lazy re-exports of the public API
        part = mod.split(".")[1]
        src_layer = _layer(LAYERS, "kvbridge", part)
        sub = ".".join(mod.split(".")[1:])
        for line, module, name in _imports(pkg, path):
            where = f"{path.relative_to(pkg.parent)}:{line}"
            if module.split(".")[0] in BENCH_ONLY:
                bad.append(f"{where}: the library imports {module} (bench only)")
            sans_io = any(sub == s or sub.startswith(s + ".") for s in SANS_IO)
            if sans_io and module.split(".")[0] in IO_MODULES:
                bad.append(f"{where}: sans-IO {mod} imports {module}")
            # ``from kvbridge.x import y`` may name the submodule y
            for target in [module] + ([f"{module}.{name}"] if name else []):
                if not target.startswith("kvbridge.") or target not in known:
                    continue
                tpart = target.split(".")[1]
                if tpart == part:
                    tsub = ".".join(target.split(".")[1:])
                    for a, b in FORBIDDEN_PAIRS:
                        if (sub == a or sub.startswith(a + ".")) and (
                            tsub == b or tsub.startswith(b + ".")
                        ):
                            bad.append(
                                f"{where}: {mod} imports {target} (transports are independent)"
                            )
                    continue
                tlayer = _layer(LAYERS, "kvbridge", tpart)
                if tlayer > src_layer or (tlayer == src_layer and not LAYERS[src_layer][1]):
                    bad.append(
                        f"{where}: {mod} (layer {src_layer}) imports {target} (layer {tlayer})"
                    )
    return bad


def _public(module: str, name: str | None, library: set[str]) -> str | None:
    """Why ``from module import name`` (or ``import module``) of kvbridge is
    not public API, or None."""
    if any(p.startswith("_") for p in module.split(".")):
        return f"{module} is a private module"
    if module not in library:
        return f"{module} is no module of kvbridge"
    if name is None or f"{module}.{name}" in library:
        return None
    if name.startswith("_"):
        return f"{module}.{name} is private"
    names = getattr(importlib.import_module(module), "__all__", None)
    if names is not None and name not in names:
        return f"{module}.{name} is not in {module}.__all__"
    return None


def _bench_violations(bench: Path, pkg: Path) -> list[str]:
    library = _known(pkg) | {"kvbridge._core", "kvbridge._ucx"}
    known = _known(bench)
    bad: list[str] = []
    for path in _modules(bench):
        mod = _modname(bench, path)
        if mod == "kvbridge_bench":
            continue
        part = mod.split(".")[1]
        src_layer = _layer(BENCH_LAYERS, "kvbridge_bench", part)
        for line, module, name in _imports(bench, path):
            where = f"{path.relative_to(bench.parent)}:{line}"
            top = module.split(".")[0]
            if top == "kvbridge":
                why = _public(module, name, library)
                if why:
                    bad.append(f"{where}: {mod} uses {module}{f' {name}' if name else ''}: {why}")
                continue
            for target in [module] + ([f"{module}.{name}"] if name else []):
                if top != "kvbridge_bench" or target not in known or target == "kvbridge_bench":
                    continue
                tpart = target.split(".")[1]
                if tpart == part:
                    continue
                tlayer = _layer(BENCH_LAYERS, "kvbridge_bench", tpart)
                lay = BENCH_LAYERS[src_layer]
                if tlayer > src_layer or (tlayer == src_layer and not lay[1]):
                    bad.append(
                        f"{where}: {mod} (layer {src_layer}) imports {target} (layer {tlayer})"
                    )
    return bad


def _copy(src: Path, dst: Path) -> Path:
    """The Python sources of package ``src`` under ``dst`` (a probe goes there,
    never into the source tree)."""
    shutil.copytree(src, dst / src.name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dst / src.name


def test_every_part_has_a_layer() -> None:
    for root, top, layers in ((PKG, "kvbridge", LAYERS), (BENCH, "kvbridge_bench", BENCH_LAYERS)):
        for p in root.iterdir():
            name = p.stem if p.suffix == ".py" else p.name
            if p.name.startswith("__") or p.suffix in (".so", ".pyi", ".typed"):
                continue
            if p.is_dir() and not (p / "__init__.py").exists():
                continue
            _layer(layers, top, name)


def test_imports_go_down_only() -> None:
    bad = _library_violations(PKG)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_bench_uses_the_public_api_only() -> None:
    bad = _bench_violations(BENCH, PKG)
    assert not bad, "the bench against kvbridge's public API:\n" + "\n".join(bad)


def test_the_library_checks_can_fail(tmp_path: Path) -> None:
    """A lower layer that imports a higher one, a sans-IO module that imports
    asyncio and a library module that imports the bench are reported."""
    pkg = _copy(PKG, tmp_path)
    (pkg / "wire" / "zz_probe.py").write_text(
        "from ..bridge import PrefillBridge\nimport asyncio\n"
        "def f():\n    from kvbridge_bench.sim import network\n    import tqdm\n"
    )
    bad = _library_violations(pkg)
    assert any("zz_probe" in b and "kvbridge.bridge" in b for b in bad), bad
    assert any("zz_probe" in b and "asyncio" in b for b in bad), bad
    assert any("zz_probe" in b and "kvbridge_bench.sim" in b for b in bad), bad
    assert any("zz_probe" in b and "tqdm" in b for b in bad), bad
    assert not _library_violations(PKG)


def test_the_bench_check_can_fail(tmp_path: Path) -> None:
    """Private modules, private names, names outside ``__all__`` and private
    module paths in strings are reported; a lower bench layer that imports a
    program is too."""
    bench = _copy(BENCH, tmp_path)
    (bench / "sim" / "zz_probe.py").write_text(
        "import importlib\n"
        "from kvbridge._pack.memory import advise_huge_pages\n"
        "from kvbridge.pack import _data_ptr\n"
        "from kvbridge.pack import thp_setting, PagedKVCache\n"
        "from kvbridge.transport.ucx import load\n"
        "from ..cli import main\n"
        "importlib.import_module('kvbridge._ucx')\n"
    )
    bad = [b for b in _bench_violations(bench, PKG) if "zz_probe" in b]
    assert any("kvbridge._pack.memory" in b for b in bad), bad
    assert any("_data_ptr" in b for b in bad), bad
    assert any("kvbridge.transport.ucx load" in b and "__all__" in b for b in bad), bad
    assert any("kvbridge_bench.cli" in b for b in bad), bad
    assert any(":7:" in b and "kvbridge._ucx" in b for b in bad), bad
    assert not any("thp_setting" in b or "PagedKVCache" in b for b in bad), bad


def test_the_library_wheel_holds_the_library_only() -> None:
    """pyproject's wheel packages name kvbridge alone, the package tree holds
    no bench part, and no dependency of the library is bench-only; the bench
    distribution ships kvbridge_bench and the kvbridge-bench command."""
    lib = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert lib["tool"]["scikit-build"]["wheel"]["packages"] == ["kvbridge"]
    assert "kvbridge-bench" not in lib["project"].get("scripts", {})
    deps = list(lib["project"]["dependencies"])
    for extra, reqs in lib["project"].get("optional-dependencies", {}).items():
        if extra not in ("test", "dev"):
            deps += reqs
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    assert not names & BENCH_ONLY, names & BENCH_ONLY
    parts = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert not parts & {"cli", "demo", "sim", "reference"}, parts
    bench = tomllib.loads((ROOT / "kvbench" / "pyproject.toml").read_text())
    assert bench["project"]["scripts"]["kvbridge-bench"] == "kvbridge_bench.cli.main:main"
    assert bench["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["kvbridge_bench"]
    assert any(d.startswith("kvbridge") for d in bench["project"]["dependencies"])


@pytest.mark.parametrize("module", ["kvbridge.cli", "kvbridge.demo", "kvbridge.sim"])
def test_the_bench_parts_are_gone_from_the_library(module: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)
