"""Parameter files of the fleet simulator: TOML, every value with its
source.

Each leaf table is ``{value = ..., source = "..."}``; a value without a
source is refused (:class:`kvbridge.errors.InvalidArgument`), so that every
number the simulator uses says where it comes from.  Tables nest:
``[wan.rate_bps]`` is read as ``params["wan.rate_bps"]``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvbridge.errors import InvalidArgument

__all__ = ["Params", "load_params", "override"]


@dataclass(frozen=True)
class Params:
    name: str
    values: dict[str, Any]
    sources: dict[str, str]
    path: str

    def __getitem__(self, key: str) -> Any:
        try:
            return self.values[key]
        except KeyError:
            raise InvalidArgument(f"{self.path}: no parameter {key!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def rows(self) -> list[tuple[str, Any, str]]:
        return [(k, v, self.sources[k]) for k, v in self.values.items()]


def _walk(prefix: str, table: dict[str, Any], values: dict[str, Any], sources: dict[str, str],
          path: str) -> None:  # fmt: skip
    for k, v in table.items():
        key = f"{prefix}{k}"
        if not isinstance(v, dict):
            if prefix == "" and k in ("name", "description"):
                continue
            raise InvalidArgument(f"{path}: {key} needs a table with value and source")
        if "value" in v:
            if not isinstance(v.get("source"), str) or not v["source"].strip():
                raise InvalidArgument(f"{path}: {key} has no source")
            values[key] = v["value"]
            sources[key] = v["source"]
        else:
            _walk(f"{key}.", v, values, sources, path)


def override(p: Params, assignments: list[str]) -> Params:
    """``p`` with ``KEY=VALUE`` assignments (TOML values) applied; the
    source of each becomes "set on the command line"."""
    values, sources = dict(p.values), dict(p.sources)
    for a in assignments:
        key, sep, text = a.partition("=")
        if not sep or key not in values:
            raise InvalidArgument(f"--set {a!r}: want KEY=VALUE with a KEY of {p.path}")
        try:
            values[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = text
        sources[key] = "set on the command line"
    return Params(p.name, values, sources, p.path)


def load_params(name_or_path: str | Path) -> Params:
    """A parameter file: a path, or the name of one shipped in
    ``kvbridge_bench/plan/params/`` (``demo``, ``paper``)."""
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.exists():
        text, path = p.read_text(), str(p)
    else:
        res = (
            resources.files("kvbridge_bench.plan")
            .joinpath("params")
            .joinpath(f"{name_or_path}.toml")
        )
        if not res.is_file():
            raise InvalidArgument(f"no parameter file {name_or_path!r}")
        text, path = res.read_text(), f"kvbridge_bench/plan/params/{name_or_path}.toml"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"{path}: {e}") from None
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    _walk("", data, values, sources, path)
    return Params(str(data.get("name", p.stem)), values, sources, path)
