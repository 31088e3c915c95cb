"""Margin-aware agreement between one engine's greedy tokens and another's logits.

Two engines that compute the same model with different arithmetic (vLLM's CPU
kernels and transformers' PyTorch ops, an fp8 cache and its emulation, two
instruction sets) produce logits that differ by a few roundings. Where two
candidates are nearly tied, one engine's argmax can then be the other's
runner-up, and an exact token comparison fails on one CPU and passes on
another. Comparing greedy continuations token for token is only right where
both sides run the same arithmetic.

The rule here, for the other cases: teacher-force engine A's tokens through
engine B (so one near-tie does not derail everything after it) and require
each of A's tokens to be B's argmax, or within a stated margin of B's maximum
logit at that step. The margin is counted in units in the last place (ulps)
of the model's dtype at the step's largest finite logit magnitude: two engines' logits for the
tiny bf16 test models differ by at most 2 bf16 ulps (measured against vLLM's
own logprobs: 0.008 at logits of about 0.9, where one ulp is 2**-8), and a gap
between two logits can be off by both of their errors, hence the default of
4 ulps. Wrong KV (a shifted page, swapped keys and values, a wrong fp8 scale)
moves logits by far more, which the tests show.

Example:
    >>> import torch
    >>> logits = torch.tensor([[0.50, 0.499, 0.1], [0.2, 0.9, 0.3]])
    >>> report = greedy_agreement(logits, [1, 1])
    >>> report.ok, report.exact, report.first_near_tie.step
    (True, 1, 0)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import HurrayArgumentError

__all__ = ["DEFAULT_ULPS", "Agreement", "Step", "greedy_agreement", "logit_margin"]

#: Default margin, in ulps of the model's dtype at a step's largest finite logit magnitude (see the module docstring).
DEFAULT_ULPS = 4


@dataclass(frozen=True)
class Step:
    """One step where the given token is not the other engine's argmax.

    Attributes:
        step: index into the compared tokens.
        token: the token the first engine chose.
        argmax: the other engine's greedy choice at that step.
        gap: ``logits[argmax] - logits[token]`` (>= 0).
        margin: the margin allowed at that step.
    """

    step: int
    token: int
    argmax: int
    gap: float
    margin: float

    def __str__(self) -> str:
        verdict = "within" if self.gap <= self.margin else "beyond"
        return (
            f"step {self.step}: token {self.token}, argmax {self.argmax}, "
            f"gap {self.gap:.4g} {verdict} margin {self.margin:.4g}"
        )


@dataclass(frozen=True)
class Agreement:
    """What :func:`greedy_agreement` found.

    Attributes:
        steps: how many tokens were compared.
        exact: how many were the other engine's argmax.
        near_ties: steps where the token was not the argmax but within the margin.
        misses: steps where it was beyond the margin: the engines disagree.
    """

    steps: int
    exact: int
    near_ties: tuple[Step, ...]
    misses: tuple[Step, ...]

    @property
    def ok(self) -> bool:
        """True when every token is the argmax or within the margin of it."""
        return not self.misses

    @property
    def first_near_tie(self) -> Step | None:
        """The first step that needed the margin, if any."""
        return self.near_ties[0] if self.near_ties else None

    def describe(self) -> str:
        """One line: the counts, the first near-tie and the first miss."""
        parts = [f"{self.exact}/{self.steps} tokens are the argmax"]
        if self.near_ties:
            parts.append(f"{len(self.near_ties)} near-tie(s), first at {self.near_ties[0]}")
        if self.misses:
            parts.append(f"{len(self.misses)} miss(es), first at {self.misses[0]}")
        return "; ".join(parts)


def logit_margin(logits: torch.Tensor, dtype: torch.dtype = torch.bfloat16, ulps: int = DEFAULT_ULPS) -> torch.Tensor:
    """Per-step margin: ``ulps`` units in the last place of ``dtype`` at each row's largest finite magnitude.

    The row's scale, not just the compared logits': their errors come from
    hidden states multiplied through the whole output layer, and grow with
    the magnitudes it produces (a TP = 4 engine's logits, reduced across
    ranks in bf16, differ from transformers' by more ulps of the top logit
    than a TP = 1 engine's). A masked (``-inf``) or otherwise non-finite
    logit is left out: it says nothing about the scale, and made the margin
    infinite (any token passed).

    Args:
        logits: ``[steps, vocab]``, any floating dtype.
        dtype: the dtype the engines compute in (its ``eps`` sets the ulp).
        ulps: how many ulps a gap may be off by.

    Returns:
        float32 ``[steps]``.

    Raises:
        HurrayArgumentError: (field ``ulps``) ``ulps`` is not a finite number ``>= 0``.
    """
    if isinstance(ulps, bool) or not isinstance(ulps, numbers.Real) or not 0 <= ulps < math.inf:
        # A negative margin is no margin at all; an infinite or NaN one would pass any token.
        raise HurrayArgumentError("ulps", f"must be a finite number >= 0, not {ulps!r}")
    lf = logits.float()
    top = torch.where(lf.isfinite(), lf.abs(), torch.zeros_like(lf)).amax(dim=-1).clamp_min(torch.finfo(dtype).tiny)
    # ulp(x) = eps * 2**floor(log2 |x|): the spacing of dtype's values around x.
    return ulps * torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(top)))


def greedy_agreement(
    logits: torch.Tensor,
    tokens: Sequence[int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    ulps: int = DEFAULT_ULPS,
) -> Agreement:
    """Check one engine's greedy ``tokens`` against another engine's teacher-forced ``logits``.

    Args:
        logits: ``[len(tokens), vocab]``; row ``i`` is the other engine's
            logits for the position of ``tokens[i]``, computed with
            ``tokens[:i]`` fed (teacher forcing).
        tokens: the first engine's greedy tokens.
        dtype: the dtype the model computes in; sets the margin's ulp.
        ulps: the margin in ulps (:func:`logit_margin`).

    Returns:
        An :class:`Agreement`; ``ok`` is the verdict.

    Raises:
        ValueError: ``logits`` is not ``[len(tokens), vocab]``.
        HurrayArgumentError: (field ``ulps``, also a ``ValueError``) ``ulps`` is not a finite number ``>= 0``.

    Example:
        >>> greedy_agreement(torch.tensor([[0.1, 0.9]]), [0]).ok
        False
    """
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"logits must be [{len(tokens)}, vocab] for {len(tokens)} tokens, not {list(logits.shape)}")
    lf = logits.float()
    margins = logit_margin(lf, dtype, ulps).tolist()
    best = lf.argmax(dim=-1).tolist()
    exact = 0
    near: list[Step] = []
    miss: list[Step] = []
    for i, (tok, top, row_margin) in enumerate(zip(tokens, best, margins)):
        tok = int(tok)
        if not 0 <= tok < lf.shape[1]:
            raise ValueError(f"token {tok} at step {i} is outside the vocabulary of {lf.shape[1]}")
        a, b = lf[i, top], lf[i, tok]
        gap = float(a - b)
        if tok == top or gap == 0.0:  # an exact tie: either index is the argmax
            exact += 1
            continue
        # A non-finite logit compared (a masked token) has no margin: a gap to it is a miss.
        finite = bool(a.isfinite() and b.isfinite())
        margin = float(row_margin) if finite else 0.0
        step = Step(i, tok, int(top), gap, margin)
        (near if finite and (gap <= margin or math.isclose(gap, margin)) else miss).append(step)
    return Agreement(len(tokens), exact, tuple(near), tuple(miss))
