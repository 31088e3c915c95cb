"""Move a decoding request from one vLLM server to another.

Both servers run :class:`~hurray_vllm.adapters.vllm.connector.HurrayConnector`:
the source with ``hurray_url`` pointing at the destination's receiver
(``hurray_listen``), so every chunk of KV it completes, prompt and generated
tokens alike, is streamed to the destination as it is computed. Migration
is then two completions:

1. the source decodes ``after`` tokens and stops; its answer's
   ``kv_transfer_params`` say up to which token its chunks are saved (and
   on their way to the destination: pushes run in the background);
2. the destination continues from prompt + those tokens with those
   ``kv_transfer_params``, so that it waits for the chunks still arriving,
   and loads the stored prefix instead of recomputing it (only the tail of
   less than one chunk is recomputed).

With greedy sampling the concatenation equals an unmoved run. Only the
OpenAI-compatible HTTP API is used (``/v1/completions`` with token-id
prompts and ``return_token_ids``), so nothing here imports vLLM.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import HurrayFormatError

__all__ = ["MigrationResult", "complete", "migrate"]


@dataclass(frozen=True)
class MigrationResult:
    """Tokens produced on each side, and what the destination did not recompute."""

    source_tokens: list[int]
    destination_tokens: list[int]
    destination_cached_tokens: int | None

    @property
    def tokens(self) -> list[int]:
        """All generated tokens: the source's, then the destination's."""
        return self.source_tokens + self.destination_tokens


def complete(
    server: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    model: str | None = None,
    timeout: float = 600.0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One greedy ``/v1/completions`` call with a token-id prompt; returns the parsed answer."""
    body: dict[str, Any] = {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if model is None:
        with urllib.request.urlopen(f"{server.rstrip('/')}/v1/models", timeout=timeout) as r:
            model = json.load(r)["data"][0]["id"]
    body["model"] = model
    body.update(extra or {})
    req = urllib.request.Request(
        f"{server.rstrip('/')}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        answer: dict[str, Any] = json.load(r)
    return answer


def _tokens(answer: dict[str, Any], server: str) -> list[int]:
    try:
        return [int(t) for t in answer["choices"][0]["token_ids"]]
    except (KeyError, IndexError, TypeError):
        raise HurrayFormatError("token_ids", f"{server} did not return token ids (is it vLLM >= 0.10?)") from None


def migrate(
    source: str,
    destination: str,
    prompt: Sequence[int],
    *,
    after: int,
    max_tokens: int,
    model: str | None = None,
) -> MigrationResult:
    """Decode ``after`` tokens on ``source``, the remaining ``max_tokens - after`` on ``destination``.

    Args:
        source: base URL of the server that decodes first (``http://host:port``).
        destination: base URL of the server that decodes the rest (``http://host:port``).
        prompt: the prompt's token ids.
        after: tokens generated on the source before the move (>= 1).
        max_tokens: tokens generated in total.
        model: the model name both servers serve; ``None`` asks each server's
            ``/v1/models`` for its first.
    """
    if not 1 <= after < max_tokens:
        raise HurrayFormatError("after", f"need 1 <= after < max_tokens, got after={after}, max_tokens={max_tokens}")
    head = complete(source, prompt, after, model=model)
    first = _tokens(head, source)
    # The source's connector announces the chunks it saved and is still pushing ({"hurray_saved_tokens": N}):
    # passed on, they make the destination wait for them rather than recompute what is on the wire.
    params = head.get("kv_transfer_params")
    extra = {"kv_transfer_params": params} if isinstance(params, dict) else None
    answer = complete(destination, [*prompt, *first], max_tokens - after, model=model, extra=extra)
    usage = answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return MigrationResult(first, _tokens(answer, destination), cached)
