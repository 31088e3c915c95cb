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
  ``hurray_vllm.agreement.DEFAULT_ULPS`` (4) bf16 ulps of its top logit, at
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

    Equal, where vLLM computes a token the same way whatever the shape of
    the work. On CPUs with AMX vLLM 0.32's attention kernels round with that
    shape: a prefill otherwise than decode steps (the same engine, continuing
    from the prompt and its first generated tokens with nothing loaded, parts
    from its own unmoved run at a near-tie, here after ~100 tokens), and a
    tensor-parallel rank's share of the heads otherwise than all of them. A
    destination computes what it did not load (the tail after the last whole
    chunk) in a prefill, so there the tokens need only meet the margin rule,
    teacher-forced through transformers (the model at ``model_dir``), and
    equal ``want`` before ``same_until`` (computed by the source, unmoved).
    """
    from hurray_vllm.adapters.vllm.layouts import cpu_has_amx

    got, want = list(got), list(want)
    if got == want:
        return
    parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert cpu_has_amx() and len(got) == len(want), f"{what}: parts from the unmoved run at token {parted}"
    assert parted >= same_until, f"{what}: parts from the unmoved run at token {parted}, before the move"
    logits = recompute_logits(_model(str(model_dir)), prompt, got)
    assert_agrees(logits, got, f"{what} (parted from the unmoved run at token {parted}: AMX kernels)")
