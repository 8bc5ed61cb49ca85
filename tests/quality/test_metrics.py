"""The harness's figures against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lmc.quality.metrics import (
    first_difference,
    kl_divergence,
    perplexity,
    token_nll,
    top1_matches,
)


def logits_of(*probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is each row of ``probs`` (log-probabilities are logits)."""
    return torch.tensor(probs, dtype=torch.float32).log()


def test_kl_of_two_coins_by_hand() -> None:
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    p = logits_of([0.5, 0.5], [0.1, 0.9])
    q = logits_of([0.25, 0.75], [0.1, 0.9])
    kl = kl_divergence(p, q)
    assert kl.dtype == torch.float64
    assert kl[0].item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    # not symmetric: KL(q || p) = 1/4 ln(1/2) + 3/4 ln(3/2)
    assert kl_divergence(q, p)[0].item() == pytest.approx(
        0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-6)


def test_kl_ignores_a_constant_added_to_the_logits() -> None:
    p = torch.tensor([[2.0, -1.0, 0.5]])
    assert kl_divergence(p, p + 7.0)[0].item() == pytest.approx(0.0, abs=1e-12)


def test_top1_agreement() -> None:
    p = logits_of([0.6, 0.4], [0.2, 0.8], [0.5, 0.5])
    q = logits_of([0.7, 0.3], [0.6, 0.4], [0.5, 0.5])
    assert top1_matches(p, q).tolist() == [True, False, True]


def test_perplexity_by_hand() -> None:
    # targets get probability 1/2 and 1/4: mean NLL = (ln 2 + ln 4) / 2 = 1.5 ln 2
    logits = logits_of([0.5, 0.5], [0.75, 0.25])
    assert token_nll(logits, [1, 1]).tolist() == pytest.approx([math.log(2), math.log(4)])
    assert perplexity(logits, [1, 1]) == pytest.approx(2 ** 1.5, rel=1e-6)
    assert perplexity(logits_of([1.0, 1e-30]), [0]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="n targets"):
        token_nll(logits, [1])


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None

