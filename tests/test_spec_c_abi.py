"""The pack core's C ABI from C: tests/spec_peer/c_abi/check.c was written by a
independent implementation written from only docs/pack.md, docs/layouts.md, protocol.md section 7 and
the public headers. It packs and unpacks between many layouts against its own
reference, in slices, concurrently, and triggers every documented error. Here
it is compiled against the core's sources (as C99, linked as pack.md says)
and must report no failure."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = [
    "status",
    "validate",
    "runs",
    "thread_pool",
    "xxh3",
    "plan",
    "pack_cpu",
    "pack_cuda_absent",
]

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") and shutil.which("c++")), reason="no C/C++ compiler here"
)


def test_a_c_program_written_from_the_docs_passes(tmp_path: Path) -> None:
    objs = []
    for name in CORE:
        obj = tmp_path / f"{name}.o"
        subprocess.run(
            ["c++", "-std=c++17", "-O1", "-I", ROOT / "csrc/include", "-I", ROOT / "csrc",
             "-c", ROOT / f"csrc/{name}.cpp", "-o", obj],
            check=True, timeout=300,
        )  # fmt: skip
        objs.append(obj)
    exe = tmp_path / "check"
    subprocess.run(
        ["cc", "-std=c99", "-O1", "-I", ROOT / "csrc/include",
         ROOT / "tests/spec_peer/c_abi/check.c", *objs,
         "-lstdc++", "-lpthread", "-lm", "-o", exe],
        check=True, timeout=300,
    )  # fmt: skip
    out = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    last = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0 and last.endswith(" 0 failures"), out.stdout[-3000:]
    assert int(last.split()[0]) > 1000  # it really checked
