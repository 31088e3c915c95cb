"""The margin rule (hurray_vllm.agreement) and the test-process helpers (tests/servers.py)."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from servers import root_cause

import hurray_vllm.agreement as agreement_module
from hurray_vllm.agreement import greedy_agreement, logit_margin
from hurray_vllm.errors import HurrayArgumentError


def test_the_module_examples_run() -> None:
    assert doctest.testmod(agreement_module).failed == 0


def test_margin_is_ulps_at_the_largest_logit() -> None:
    ulp_bf16_at_1 = 2.0**-7  # bf16 keeps 8 significant bits: values in [1, 2) are 2**-7 apart
    m = logit_margin(torch.tensor([[1.5, -0.2], [-3.0, 0.1], [0.3, 0.2]]))
    assert m.tolist() == [4 * ulp_bf16_at_1, 4 * 2 * ulp_bf16_at_1, 4 * ulp_bf16_at_1 / 4]  # at 1.5, 3.0, 0.3
    assert logit_margin(torch.tensor([[1.0, 0.0]]), torch.float32, ulps=1).item() == 2.0**-23
    with pytest.raises(ValueError, match="ulps"):
        logit_margin(torch.zeros(1, 2), ulps=-1)


@pytest.mark.parametrize("ulps", [-1, math.inf, math.nan, "4", True])
def test_a_bad_margin_is_an_argument_error_naming_ulps(ulps: object) -> None:
    """The caller's margin: HurrayArgumentError (still a ValueError), not a bare ValueError or TypeError."""
    with pytest.raises(HurrayArgumentError) as err:
        greedy_agreement(torch.zeros(1, 2), [0], ulps=ulps)  # type: ignore[arg-type]
    assert err.value.field == "ulps" and isinstance(err.value, ValueError)


def test_masked_logits_do_not_widen_the_margin() -> None:
    """A -inf (a masked token) made the margin infinite: any token passed."""
    assert logit_margin(torch.tensor([[-math.inf, 5.0, -3.0]])).item() == 4 * 2.0**-7 * 4  # ulps at 5
    for masked in (-math.inf, math.inf, math.nan):
        assert logit_margin(torch.tensor([[masked, 1.0]])).item() == 4 * 2.0**-7
    r = greedy_agreement(torch.tensor([[-math.inf, 5.0, -3.0]]), [2])
    assert not r.ok and len(r.misses) == 1
    r = greedy_agreement(torch.tensor([[-math.inf, 5.0, 1.0]]), [0])  # the masked token itself: a miss
    assert not r.ok


def test_argmax_near_tie_and_miss() -> None:
    logits = torch.tensor(
        [
            [0.9, 0.1, 0.0],  # token 0: the argmax
            [0.5, 0.49, 0.0],  # token 1: 0.01 below, within 4 ulps at 0.5 (0.0156)
            [0.5, 0.3, 0.0],  # token 1: 0.2 below: a miss
            [0.25, 0.25, 0.0],  # token 1: an exact tie counts as the argmax
        ]
    )
    r = greedy_agreement(logits, [0, 1, 1, 1])
    assert not r.ok and r.steps == 4 and r.exact == 2
    assert [s.step for s in r.near_ties] == [1] and [s.step for s in r.misses] == [2]
    assert r.first_near_tie is not None and r.first_near_tie.argmax == 0 and r.first_near_tie.token == 1
    assert "1 miss(es), first at step 2: token 1, argmax 0, gap 0.2 beyond margin" in r.describe()
    assert greedy_agreement(logits[:2], [0, 1]).ok
    # A tighter margin turns the near-tie into a miss.
    assert not greedy_agreement(logits[:2], [0, 1], ulps=1).ok


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"\[2, vocab\]"):
        greedy_agreement(torch.zeros(3, 4), [0, 1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        greedy_agreement(torch.zeros(1, 4), [4])
    assert greedy_agreement(torch.zeros(0, 4), []).ok


def test_root_cause_shows_the_first_error_not_only_the_tail() -> None:
    log = "\n".join(
        [*(f"INFO line {i}" for i in range(100)), "Traceback (most recent call last):", "  File x", "OSError: boom"]
        + [f"shutdown noise {i}" for i in range(200)]
    )
    got = root_cause(log)
    assert "Traceback (most recent call last)" in got and "OSError: boom" in got
    assert "INFO line 99" in got and "INFO line 50" not in got  # a few lines of context before it
    assert got.rstrip().endswith("shutdown noise 199")  # and the tail
    assert len(got.splitlines()) < 100
    assert root_cause("just\nlines") == "just\nlines"
