"""The demo's reference streams: computed once, kept on disk under a key of
everything they depend on, computed again when the file is damaged; the
teacher-forced check finds a reference stream exact and a changed one not."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from kvbridge.errors import Cancelled
from kvbridge.handoff.params import SamplingParams
from kvbridge_bench.demo.config import DemoConfig
from kvbridge_bench.demo.engines import (
    cached_reference_streams,
    reference_key,
    reference_streams,
    verify_streams,
)


def _requests(n: int = 3) -> list[tuple[int, list[int], SamplingParams]]:
    rng = random.Random(0)
    system = [rng.randrange(2048) for _ in range(200)]
    return [
        (
            i,
            system + [rng.randrange(2048) for _ in range(10 + i)],
            SamplingParams(temperature=0.7, top_k=40, seed=i, max_new_tokens=6),
        )
        for i in range(n)
    ]


Streams = dict[int, tuple[list[int], list[float]]]


def _same_streams(a: Streams, b: Streams) -> bool:
    """The same tokens, and margins equal up to float rounding: two
    computations of one stream in one process may round differently (seen
    on the CI VM: margins apart in the fifth significant digit, the tokens
    the same)."""
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and a[k][1] == pytest.approx(b[k][1], rel=1e-4, abs=1e-5) for k in a
    )


@pytest.mark.timeout(120)
def test_reference_streams_are_cached_by_key(tmp_path: Path) -> None:
    cfg = DemoConfig.smoke()
    reqs = _requests()
    first, hit = cached_reference_streams(cfg, reqs, tmp_path)
    assert not hit and _same_streams(first, reference_streams(cfg, reqs))
    again, hit = cached_reference_streams(cfg, reqs, tmp_path)
    assert hit and again == first  # the file holds exactly what was computed
    # another request set, another model: other keys
    assert reference_key(cfg, reqs[:2]) != reference_key(cfg, reqs)
    assert reference_key(cfg.replace(model_seed=1), reqs) != reference_key(cfg, reqs)
    # a damaged file is computed again
    (path,) = tmp_path.glob("refs-*.json")
    path.write_text("{not json")
    fixed, hit = cached_reference_streams(cfg, reqs, tmp_path)
    assert not hit and _same_streams(fixed, first)


@pytest.mark.timeout(120)
def test_reference_streams_stop() -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled):
        reference_streams(DemoConfig.smoke(), _requests(), stop=stop)


@pytest.mark.timeout(120)
def test_verify_streams_exact_and_changed() -> None:
    cfg = DemoConfig.smoke()
    reqs = _requests()
    refs = reference_streams(cfg, reqs)
    ok = verify_streams(cfg, [(r, p, pr, refs[r][0]) for r, p, pr in reqs])
    assert all(d == 0.0 for d in ok.values()), ok
    bad = list(refs[1][0])
    bad[2] = (bad[2] + 1) % 2048
    assert verify_streams(cfg, [(1, reqs[1][1], reqs[1][2], bad)])[1] > 1.0


def test_deficit_at_the_top_k_boundary_is_a_near_tie() -> None:
    """A token one rounding step below the k-th logit (another computation of
    the same logits kept it in the top k) is a near tie with that small gap,
    not an impossible token; one far below the k-th logit stays far."""
    import torch

    from kvbridge.handoff.sampling import sample
    from kvbridge_bench.demo.engines import _deficit

    params = SamplingParams(temperature=0.7, top_k=4, seed=3, max_new_tokens=8)
    logits = torch.tensor([20.0, 19.0, 18.0, 17.0, 16.875, 5.0, 4.0, 3.0], dtype=torch.bfloat16)
    for index in range(8):
        won = sample(logits, params, index)
        assert _deficit(logits, params, index, won) == 0.0
    # token 4 is just outside the top 4: the other computation had it at 17.0
    bumped = logits.clone()
    bumped[4] = 17.0
    index = next(i for i in range(200) if sample(bumped, params, i) == 4)
    d = _deficit(logits, params, index, 4)
    assert 0.0 < d <= 0.125 / 0.7 + 1e-9  # one bf16 step at 17
    # token 5 is 12 logits below the 4th: never a near tie
    assert _deficit(logits, params, index, 5) > 10.0
    # greedy: the gap to the best logit
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert _deficit(logits, greedy, 0, 1) == 1.0
