"""docs/vllm.md shows the exact commands that tests/test_vllm_e2e.py starts
(at the docs' fixed ports; the tests take free ones and put the WAN emulator
at the main decode's kvbridge address).  Needs no vLLM."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_e2e_spec import e2e_spec

from kvbridge_bench.cli.vllm_cluster import VllmCluster

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
PORTS = {"p": 8100, "md": 8200, "rld": 8300, "md_kvb": 7400, "rld_kvb": 7401, "proxy": 8000}


def _doc_commands() -> str:
    text = DOC.read_text()
    block = text[text.index("## 3. Running prefill and decode engines") :]
    block = block[block.index("```") + 3 :]
    block = block[: block.index("```")]
    return re.sub(r"\s+", " ", block.replace("\\\n", " "))


def test_docs_show_the_commands_the_end_to_end_tests_run(tmp_path: Path) -> None:
    cluster = VllmCluster(e2e_spec("/MODEL", tmp_path))
    cluster.ports = dict(PORTS)
    cluster.use_ucx = True  # the relay path where kvbridge has UCX
    cmds = cluster.commands()
    cmds["p"] = cluster.prefill_spec(md_addr=("127.0.0.1", PORTS["md_kvb"])).command_line()
    doc = _doc_commands()
    for role in ("md", "rld", "p", "proxy"):
        want = re.sub(r"\s+", " ", cmds[role]).replace("/MODEL", "$M")
        assert want in doc, f"docs/vllm.md lacks the {role} command:\n{want}"
