"""Counter-based sampling: a token depends only on (seed, index, logits)."""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import InvalidArgument
from kvbridge_bench.reference import SamplingParams, is_last, sample


def logits(seed: int, n: int = 64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax() -> None:
    x = logits(0)
    assert sample(x, SamplingParams(), 5) == int(x.argmax())


def test_depends_only_on_seed_index_logits() -> None:
    p = SamplingParams(temperature=1.0, seed=42)
    x = logits(1)
    draws = [sample(x, p, i) for i in range(50)]
    torch.manual_seed(123)  # the global RNG plays no part
    assert draws == [sample(x.clone(), p, i) for i in range(50)]
    assert len(set(draws)) > 5  # it does sample
    other = [sample(x, SamplingParams(temperature=1.0, seed=43), i) for i in range(50)]
    assert other != draws


def test_top_k_and_top_p_restrict_support() -> None:
    x = logits(2)
    top3 = set(torch.topk(x, 3).indices.tolist())
    assert {
        sample(x, SamplingParams(temperature=2.0, top_k=3, seed=1), i) for i in range(200)
    } <= top3
    probs = torch.softmax(x, 0)
    best = int(probs.argmax())
    p = float(probs[best]) * 0.5  # only the best token survives
    assert {sample(x, SamplingParams(temperature=1.0, top_p=p), i) for i in range(50)} == {best}


def test_is_last() -> None:
    p = SamplingParams(max_new_tokens=3, eos_token_id=7)
    assert not is_last(0, 1, p) and is_last(2, 1, p) and is_last(0, 7, p)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -1},
        {"seed": -1},
        {"max_new_tokens": 0},
        {"temperature": float("nan")},
        {"eos_token_id": -2},
    ],
)
def test_bad_params(kw: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_bad_logits() -> None:
    with pytest.raises(InvalidArgument):
        sample(torch.zeros(2, 3), SamplingParams(), 0)
