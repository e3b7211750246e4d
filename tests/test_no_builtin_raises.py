"""No library path raises a built-in exception where a kvbridge error
belongs: every ``raise`` of a built-in exception class anywhere in the
library (all layers) and in the bench (kvbridge_bench: the programs, the
demo, the simulation) fails this test unless the allow-list below names it
with its reason."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKGS = [ROOT / "kvbridge", ROOT / "kvbench" / "kvbridge_bench"]

BUILTIN_EXCEPTIONS = {
    name for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}  # fmt: skip

# (file relative to the package's parent, exception): why a built-in is right there
ALLOWED = {
    # a module's __getattr__ must raise AttributeError (the import protocol)
    ("kvbridge/__init__.py", "AttributeError"),
    ("kvbridge/integrations/vllm/__init__.py", "AttributeError"),
    # RadixCache.validate() is the tests' invariant checker: an assertion
    ("kvbridge/cache/radix.py", "AssertionError"),
    # a failed libc setns() reported with its errno, as the os module does;
    # the caller maps it (netns.enter_netns)
    ("kvbridge_bench/sim/emulator/netns.py", "OSError"),
}
# raised to end a generator or to mark an abstract method: not errors
NOT_ERRORS = {"StopIteration", "StopAsyncIteration", "NotImplementedError", "KeyboardInterrupt",
              "SystemExit", "GeneratorExit"}  # fmt: skip


def builtin_raises() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(p for pkg in PKGS for p in pkg.rglob("*.py")):
        rel = next(path.relative_to(pkg.parent) for pkg in PKGS if pkg in path.parents).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.id if isinstance(exc, ast.Name) else None
            allowed = name in NOT_ERRORS or (rel, name) in ALLOWED
            if name in BUILTIN_EXCEPTIONS and not allowed:
                out.append((rel, node.lineno, name))
    return out


def test_no_bare_builtin_raises_in_the_package() -> None:
    found = builtin_raises()
    assert not found, "raise a kvbridge.errors class instead:\n" + "\n".join(
        f"  {f}:{line}: raise {name}" for f, line, name in found
    )


def test_the_scan_finds_a_bare_raise(tmp_path: Path) -> None:
    """The scan would catch a new one (the allow-list is not a blanket)."""
    tree = ast.parse("def f():\n    raise ValueError('x')\n")
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.Raise)]
    assert isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name)
    assert node.exc.func.id in BUILTIN_EXCEPTIONS - NOT_ERRORS
    assert all(isinstance(a, str) and b in BUILTIN_EXCEPTIONS for a, b in ALLOWED)
