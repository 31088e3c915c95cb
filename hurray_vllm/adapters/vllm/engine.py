"""Snapshots of live requests in an in-process ``vllm.LLM``.

Drive the engine step by step (``llm.llm_engine.add_request(...)``,
``llm.llm_engine.step()``) and call :func:`snapshot` between steps: the
engine core runs in the calling thread, so nothing schedules or frees blocks
while a snapshot reads them. With synchronous scheduling (the CPU platform's
only mode) each ``step()`` runs its forward pass to its end, so between two
calls no forward pass writes the cache. With asynchronous scheduling (vLLM's
default on GPUs) a step may still be in flight when ``step()`` returns: its
forward pass writes the KV of the last sampled token (and of any drafts). The
snapshot exports that token's KV, not the drafts' (``_committed``), and its
gathers are queued on the CUDA stream the step runs on, behind the step's
cache writes, so they read what the step wrote.

Requires ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in this
process); its workers may run here (vLLM's ``UniProcExecutor``, the default at
tensor parallelism 1) or in processes of their own (the ``"mp"`` or ``"ray"``
executor, any TP), where each rank exports on its worker. For engines in
other processes or servers, use the KV connector.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ...chunks.keys import KEY_SEEDS, namespace_of
from ...containers.io import write_stream
from ...errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError, Violation
from ...kv.heads import concat_heads, distinct_ranks
from ...kv.snapshot import TARGET_LAYERS, KVSnapshot
from ...kv.states import RecurrentStates, join_states
from .cache import (
    EngineCache,
    attention_layers,
    cache_groups,
    cache_layers,
    describe_worker_cache,
    fingerprint_of,
    group_options,
    rank_share,
    split_states_refusal,
    target_layers,
    unsupported_cache,
    unsupported_parallelism,
    with_heads,
)
from .export import SequenceState, export_snapshot, export_stream

__all__ = ["snapshot", "snapshot_ranks", "snapshot_stream", "engine_cache", "request_states", "layer_caches"]

#: Seconds :func:`snapshot`, :func:`snapshot_stream` and :func:`snapshot_ranks` wait for workers in processes
#: of their own (vLLM's multiprocessing or Ray executor, at any tensor parallelism): a worker that hangs (a stuck
#: collective, a file system that stopped answering) fails the call with ``TimeoutError`` instead of blocking it
#: for ever. A worker in this process (vLLM's ``UniProcExecutor``) runs to its end. vLLM does not cancel the
#: work: the late answers would reach the engine's next ``collective_rpc``, so restart the engine after such a
#: timeout.
WORKER_TIMEOUT_S = 3600.0

#: The most characters of a worker's traceback a :class:`_WorkerError` carries (its last ones).
_TRACE_CHARS = 8000


@dataclass(frozen=True)
class _WorkerError:
    """An error a worker function raised, returned as a value (:func:`_on_worker`) and raised by the caller."""

    kind: str  # the class's name: one of _ERRORS, a built-in OSError's, or (other) any exception's
    field: str = ""  # a Hurray error's .field
    message: str = ""  # a Hurray error's, without the "field: " prefix; another exception's text
    violations: tuple[Violation, ...] = ()
    #: An OSError's (errno, strerror[, filename[, None, filename2]]), or its text where it has no strerror.
    os_args: tuple[int | str | None, ...] = ()
    #: Any other exception (not a Hurray error nor an OSError): raised here as ``RuntimeError``.
    other: bool = False
    #: Another exception's traceback on the worker (its last :data:`_TRACE_CHARS` characters).
    trace: str = ""
    #: Another exception itself, where the worker runs in this process; never pickled (not every exception
    #: pickles, and a process of its own answers with the text above).
    local: Exception | None = dataclass_field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "local": None}

    @classmethod
    def of(cls, exc: Exception) -> _WorkerError:
        """``exc`` as a value a worker can return (plain types only: pickled by vLLM, and unpickled here)."""
        if isinstance(exc, OSError):
            kind = type(exc).__name__ if getattr(builtins, type(exc).__name__, None) is type(exc) else "OSError"
            if exc.strerror is None:
                return cls(kind, os_args=(str(exc),))
            names = [n if n is None or isinstance(n, str) else str(n) for n in (exc.filename, exc.filename2)]
            args: tuple[int | str | None, ...] = (exc.errno, exc.strerror)
            if names[1] is not None:  # OSError(errno, strerror, filename, winerror, filename2)
                args += (names[0], None, names[1])
            elif names[0] is not None:
                args += (names[0],)
            return cls(kind, os_args=args)
        if isinstance(exc, (HurrayFormatError, HurrayArgumentError)):  # the classes of _ERRORS
            kind = next(k for k, c in _ERRORS.items() if isinstance(exc, c))  # the most derived first
            message = str(exc).removeprefix(f"{exc.field}: ")
            return cls(kind, exc.field, message, tuple(getattr(exc, "violations", ())))
        trace = "".join(traceback.format_exception(exc))[-_TRACE_CHARS:]
        return cls(type(exc).__name__, message=_text(exc), other=True, trace=trace, local=exc)

    def error(self, rank: int) -> Exception:
        """The exception to raise here: the worker's, rebuilt (its class, ``field`` and message; an errno).

        Another exception: itself where the worker ran in this process, else
        ``RuntimeError("rank N: Type: message")`` with the worker's traceback
        as a note.
        """
        exc: Exception
        cls = _ERRORS.get(self.kind)
        if self.other:
            if self.local is not None:
                exc = self.local
            else:
                exc = RuntimeError(
                    f"rank {rank}: {self.kind}: {self.message}" if self.message else f"rank {rank}: {self.kind}"
                )
        elif cls is HurrayFormatError:
            exc = HurrayFormatError(self.field, self.message, self.violations or None)
        elif cls is not None:
            exc = cls(self.field, self.message)
        else:
            exc = getattr(builtins, self.kind, OSError)(*self.os_args)
        exc.add_note(f"(raised on worker {rank})")
        if self.other and self.local is None and self.trace:
            exc.add_note(f"the worker's traceback:\n{self.trace}")
        return exc


def _text(exc: BaseException) -> str:
    """``str(exc)``, or its class's name where even that fails."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__} whose str() failed>"


#: What a worker's error is returned as, by class name: the most derived first.
_ERRORS: dict[str, type[HurrayFormatError] | type[HurrayArgumentError]] = {
    "ImportArgumentError": ImportArgumentError,
    "HurrayArgumentError": HurrayArgumentError,
    "HurrayFormatError": HurrayFormatError,
}


def _on_worker(worker: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs on every worker: ``fn(worker, *args)``, or any exception it raised returned as a value.

    vLLM's multiprocessing executor passes a worker's exception on as
    ``RuntimeError("Worker failed with error '<text>'")``: a
    :class:`HurrayFormatError`'s type and ``field``, an ``OSError``'s errno,
    are lost. Worse, it reads the ranks' replies in rank order and raises at
    the first failed one, leaving the later ranks' replies queued, where the
    next call would read them as its own (and join one call's KV heads with
    another's). Returned as a :class:`_WorkerError`, every rank answers every
    call, and the caller raises the error (:func:`_raise_failed`): a Hurray
    error or an ``OSError`` as the worker raised it, any other exception as
    ``RuntimeError("rank N: Type: message")`` (itself, where the worker runs
    in this process). ``KeyboardInterrupt``, ``SystemExit`` and anything
    else that is a ``BaseException`` but no ``Exception`` are not caught.
    """
    try:
        return fn(worker, *args)
    except Exception as exc:
        return _WorkerError.of(exc)


def _rpc(llm: Any, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(worker, *args)`` on every worker, in rank order: its result, or a :class:`_WorkerError`."""
    return list(llm.collective_rpc(_on_worker, timeout=WORKER_TIMEOUT_S, args=(fn, *args)))


def _raise_failed(results: Sequence[Any]) -> None:
    """Raise the first worker's error among ``results`` (:func:`_rpc`), as that worker raised it."""
    for rank, result in enumerate(results):
        if isinstance(result, _WorkerError):
            raise result.error(rank)


def _core(llm: Any) -> Any:
    try:
        return llm.llm_engine.engine_core.engine_core
    except AttributeError:
        raise HurrayFormatError(
            "engine",
            "the engine core is not in this process; start vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "or export through HurrayConnector",
        ) from None


def _kv_cache_config(llm: Any) -> Any:
    """The engine's KV cache groups (``KVCacheConfig``), as its scheduler holds them; None if it has none."""
    return getattr(_core(llm).scheduler.kv_cache_manager, "kv_cache_config", None)


def _workers_here(llm: Any) -> bool:
    """Whether the engine's worker runs in this process, so that its cache tensors can be read here.

    vLLM 0.32's ``UniProcExecutor`` (``distributed_executor_backend="uni"``,
    the default at tensor parallelism 1) holds its one worker as
    ``driver_worker``; the multiprocessing (``"mp"``) and Ray executors run
    every worker elsewhere, whatever the TP size (``"mp"`` at TP = 1, or data
    parallelism), and hold none.
    """
    return getattr(getattr(_core(llm), "model_executor", None), "driver_worker", None) is not None


def _refuse_workers_elsewhere(llm: Any, what: str) -> None:
    if not _workers_here(llm):
        executor = type(getattr(_core(llm), "model_executor", None)).__name__
        backend = getattr(llm.llm_engine.vllm_config.parallel_config, "distributed_executor_backend", None)
        raise HurrayFormatError(
            "distributed_executor_backend",
            f"{what} returns the worker's cache tensors, and this engine's workers run in processes of their own "
            f"({executor}, distributed_executor_backend={backend!r}): use snapshot(), snapshot_stream() or "
            "snapshot_ranks(), which export on the workers, or start the engine with "
            "distributed_executor_backend='uni' (tensor parallelism 1) to have its worker in this process",
        )


def _tp_rank() -> int:
    """The tensor-parallel rank of the worker this runs on."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def layer_caches(vllm_config: Any) -> tuple[list[str], list[torch.Tensor]]:
    """Attention layer names and their cache tensors, in model order.

    Pass a worker's ``vllm_config`` (``worker.vllm_config``, in
    ``collective_rpc``): the layers are those of the model loaded in this
    process (its ``compilation_config.static_forward_context``); where the
    workers run in other processes, this process's has none, and the lists
    are empty.

    Raises:
        AttributeError: ``vllm_config`` is not a vLLM config (it has no
            ``compilation_config.static_forward_context``). Nothing else:
            the caches are returned as vLLM holds them, unchecked
            (:func:`engine_cache` checks them).
    """
    names, caches = [], []
    for name, m in attention_layers(vllm_config).items():
        kv = m.kv_cache[0] if isinstance(m.kv_cache, (list, tuple)) else m.kv_cache
        names.append(name)
        caches.append(kv)
    return names, caches


def _describe(worker: Any) -> EngineCache:
    """Runs on the worker (in-process: same objects, no copies)."""
    names, caches = layer_caches(worker.vllm_config)
    runner = getattr(worker, "model_runner", None)
    return describe_worker_cache(worker.vllm_config, caches, names, getattr(runner, "kv_cache_config", None))


def _worker_groups(worker: Any, ec: EngineCache) -> dict[str, Any]:
    """``layer_groups`` and ``group_windows`` of ``ec``'s layers, from the worker's KV cache groups (else none).

    The worker's copy of the groups (``model_runner.kv_cache_config``), not
    the scheduler's: vLLM adds the layers that reuse another layer's KV
    (cross-layer KV sharing) to the worker's copy only, and the worker's
    attention layers, which :func:`layer_caches` lists, include them.
    """
    config = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    return group_options(*cache_groups(config), ec.layer_names)


def _describe_here(worker: Any) -> tuple[EngineCache, dict[str, Any]]:
    """Runs on the worker in this process: its cache, and its layer groups (:func:`_worker_groups`)."""
    ec = _describe(worker)
    return ec, _worker_groups(worker, ec)


def engine_cache(llm: Any) -> EngineCache:
    """Describe the KV cache of an in-process ``vllm.LLM`` whose worker runs in this process.

    The :class:`~.cache.EngineCache` holds the worker's own cache tensors
    (no copies). Where the workers run in processes of their own (vLLM's
    ``"mp"`` or ``"ray"`` executor, any tensor parallelism) their tensors
    cannot be returned here: refused, not copied over (use
    :func:`snapshot`, :func:`snapshot_stream` or :func:`snapshot_ranks`,
    which export on the workers).

    Raises:
        HurrayFormatError: field ``engine`` (the engine core is not in this
            process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
            ``distributed_executor_backend`` (the workers run in processes of
            their own); a cache hurray-vllm cannot read
            (:func:`~.cache.describe_worker_cache`): ``kv_cache_dtype``,
            ``cache``, ``layers``, ``block_size``, ``kv_scales``, ``isa``.
        OSError: a weight file could not be read for the model's fingerprint
            (:func:`~.cache.weights_digest`).
        Exception: anything else the worker raised, as it raised it.
    """
    _refuse_workers_elsewhere(llm, "engine_cache()")
    results = _rpc(llm, _describe)
    _raise_failed(results)
    ec: EngineCache = results[0]
    return ec


def _cache_here(llm: Any) -> tuple[EngineCache, dict[str, Any]]:
    """The cache of the worker in this process and its layer groups (:func:`_describe_here`)."""
    _refuse_workers_elsewhere(llm, "an export in this process")
    results = _rpc(llm, _describe_here)
    _raise_failed(results)
    here: tuple[EngineCache, dict[str, Any]] = results[0]
    return here


def _tp(llm: Any) -> int:
    return int(getattr(llm.llm_engine.vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)


def _export_on_rank(worker: Any, seqs: Sequence[SequenceState]) -> tuple[int, KVSnapshot | RecurrentStates | None]:
    """Runs on every worker: what the join needs of this rank's KV of ``seqs`` (copied out, ready to pickle).

    A rank whose KV heads it exports (:func:`~.cache.rank_share`): a snapshot
    of those heads, with its share of a linear-attention hybrid's states.
    Another rank (a replica of another rank's heads, or any rank but 0 for an
    MLA latent or a single KV head, which every rank holds whole) exports no
    KV: it returns its share of the states alone, or ``None``.
    """
    rank = _tp_rank()
    heads, writes = rank_share(worker.vllm_config, rank)
    ec = _describe(worker)  # states that do not split were refused in the caller (_refuse_split_states)
    states = _states(ec, seqs)
    if not writes:
        return rank, states
    snap = export_snapshot(
        ec.caches, ec.layout, seqs, **ec.export_options(), **_worker_groups(worker, ec), states=states
    )
    return rank, with_heads(snap, heads)


def _refuse_split_states(llm: Any, what: str, *, per_rank: bool = False) -> None:
    """At TP > 1, refuse a linear-attention hybrid whose states cannot split across the ranks, before any worker.

    Each rank holds a share of the states (``kv.states``): states whose split
    is known (gated delta nets) join in any TP degree. ``per_rank``: each
    rank writes its own KV heads with their share of the states, which with
    fewer KV heads than ranks lies on several ranks: refused.
    """
    from .states import declared_layout, state_groups

    config = _kv_cache_config(llm)
    if _tp(llm) == 1 or config is None or not state_groups(config):
        return
    vllm_config = llm.llm_engine.vllm_config
    why = split_states_refusal(vllm_config)
    if why is not None:
        raise HurrayFormatError("tensor_parallel_size", f"{what}: hurray-vllm {why}")
    declared_layout(config, _tp(llm))  # raises for states it does not split
    heads = int(vllm_config.model_config.get_total_num_kv_heads())
    if per_rank and heads < _tp(llm):
        raise HurrayFormatError(
            "tensor_parallel_size",
            f"{what}: with {heads} KV heads over {_tp(llm)} ranks, the states of a head lie on several ranks; "
            "use snapshot(), which joins them",
        )


def _snapshot_tp(llm: Any, seqs: Sequence[SequenceState]) -> KVSnapshot:
    """The ranks export on their workers; one snapshot of them all, in model order (replicas and latents once).

    Each distinct run of KV heads comes from the one rank that exports it
    (:func:`_export_on_rank`); a linear-attention hybrid's states from every
    rank's share, replicas' included.
    """
    results = _rpc(llm, _export_on_rank, list(seqs))
    _raise_failed(results)
    replies = dict(results)
    parts = {r: p for r, p in replies.items() if isinstance(p, KVSnapshot)}
    if not parts:
        raise HurrayFormatError(
            "tensor_parallel_size", f"none of the {len(replies)} ranks exported KV: the workers' configs disagree"
        )
    first = parts[min(parts)]
    if first.is_latent:  # an MLA latent is on every rank: rank 0 alone exports it
        return first
    shares = [p.states if isinstance(p, KVSnapshot) else p for _, p in sorted(replies.items())]
    states = join_states([s for s in shares if s is not None]) if any(s is not None for s in shares) else None
    if states is not None:
        parts = {r: replace(p, states=None) for r, p in parts.items()}
    fp = first.fingerprint
    heads = fp.num_kv_heads if fp is not None else first.tensors()[0].num_heads * len(parts)
    ranks = distinct_ranks(heads, len(replies))
    missing = [r for r in ranks if r not in parts]
    if missing:
        raise HurrayFormatError(
            "tensor_parallel_size",
            f"{heads} KV heads over {len(replies)} ranks are exported by ranks {ranks}, but ranks {missing} "
            "exported none: the workers' configs disagree with the model's",
        )
    joined = parts[ranks[0]] if len(ranks) == 1 else concat_heads([parts[r] for r in ranks])
    return joined if states is None else replace(joined, states=states)


def _internal_id(llm: Any, core: Any, request_id: str) -> str:
    requests = core.scheduler.requests
    if request_id in requests:
        internal = request_id
    else:
        live = [i for i in llm.llm_engine.output_processor.external_req_ids.get(request_id, []) if i in requests]
        if not live:
            raise HurrayFormatError(
                "request_id", f"no live request {request_id!r} in the engine (unknown, or already finished and freed)"
            )
        if len(live) > 1:
            raise HurrayFormatError("request_id", f"{request_id!r} names {len(live)} requests (n > 1 sampling)")
        internal = live[0]
    _refuse_child(llm, request_id, internal)
    return internal


def _refuse_child(llm: Any, request_id: str, internal: str) -> None:
    """Refuse a request of ``n > 1`` sampling: one of several children, even once the others finished.

    vLLM runs such a request as ``n`` children under the id given to
    ``add_request``, each with its own generated tokens (and KV); whichever
    child runs last is not the request the id names.
    """
    states = getattr(llm.llm_engine.output_processor, "request_states", None) or {}
    if getattr(states.get(internal), "parent_req", None) is not None:
        raise HurrayFormatError(
            "request_id",
            f"{request_id!r} is a request of n > 1 sampling: its children generate tokens (and KV) of their own, "
            "and the id names none of them",
        )


def _request_ids(request_ids: Iterable[str]) -> list[str]:
    """The ids as a list, each a ``str``: read once, as a generator given for them can be read only once.

    vLLM's request ids are ``str`` (its ``add_request`` refuses any other),
    so another object can name no live request: the caller's mistake.
    """
    if isinstance(request_ids, (str, bytes)):
        raise HurrayArgumentError(
            "request_ids",
            f"expected a sequence of request ids, got the {type(request_ids).__name__} {request_ids!r} (each of its "
            f"characters would be taken as an id): pass [{request_ids!r}]",
        )
    ids = list(request_ids)
    for i, rid in enumerate(ids):
        if not isinstance(rid, str):
            raise HurrayArgumentError(
                "request_ids",
                f"element {i} is a {type(rid).__name__}, not a str: pass the str ids given to add_request",
            )
    return ids


def request_states(llm: Any, request_ids: Sequence[str]) -> list[SequenceState]:
    """Block ids, computed tokens and token ids of live requests (scheduler side).

    Raises:
        HurrayArgumentError: (field ``request_ids``) a ``str`` (or ``bytes``)
            instead of a sequence of ids: pass ``[request_id]``; an id that
            is not a ``str`` (vLLM's ids are).
        HurrayFormatError: field ``engine`` (the engine core is not in this
            process); ``kv_cache_groups`` (a model whose KV cache hurray-vllm
            cannot export: :func:`~.cache.unsupported_cache`); ``request_id``
            (an unknown or finished request, one of ``n > 1`` sampling, one
            still loading its KV through a connector, one preempted, whose KV
            vLLM freed, or one whose computed tokens the tokens in flight do
            not explain).
    """
    request_ids = _request_ids(request_ids)
    core = _core(llm)
    sched = core.scheduler
    vllm_config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    replay = bool(getattr(getattr(vllm_config, "cache_config", None), "use_replayssm", False))
    why = unsupported_cache(_kv_cache_config(llm), sliding_windows=True, replay_ssm=replay)
    if why is not None:
        raise HurrayFormatError("kv_cache_groups", f"cannot snapshot this engine: {why}")
    out = []
    for rid in request_ids:
        internal = _internal_id(llm, core, rid)
        req = sched.requests[internal]
        if req.is_finished():
            raise HurrayFormatError("request_id", f"request {rid!r} has finished; its blocks may be reused")
        if getattr(getattr(req, "status", None), "name", None) == "PREEMPTED":
            # vLLM's Scheduler._preempt_request frees its blocks and sets num_computed_tokens to 0.
            raise HurrayFormatError(
                "request_id", f"request {rid!r} was preempted (its KV was freed); snapshot it after it resumes"
            )
        if getattr(getattr(req, "status", None), "name", None) == "WAITING_FOR_REMOTE_KVS":
            # vLLM allocates its blocks and counts the tokens being loaded as computed before the load ends.
            raise HurrayFormatError(
                "request_id",
                f"request {rid!r} is still loading its KV (WAITING_FOR_REMOTE_KVS); "
                "snapshot it after its load finishes",
            )
        tokens = list(req.all_token_ids)
        groups = tuple(list(g) for g in sched.kv_cache_manager.get_block_ids(internal))
        out.append(SequenceState(rid, groups[0], _committed(rid, req, len(tokens)), tokens, group_block_ids=groups))
    return out


def _committed(rid: str, req: Any, num_tokens: int) -> int:
    """The tokens of ``req`` whose KV the snapshot exports: those computed, less drafts still being verified.

    With asynchronous scheduling (vLLM's default on GPUs) the scheduler adds a
    step's tokens to ``num_computed_tokens`` when it schedules the step, and
    ``num_output_placeholders`` counts the tokens that step (and any before it
    whose output is not processed) will sample. Between two ``step()`` calls
    the step in flight feeds the last sampled token (in ``all_token_ids``)
    and, with speculative decoding, one draft per further placeholder: drafts
    that may be rejected and are not in ``all_token_ids``. So the committed
    tokens with KV are ``num_computed_tokens`` less ``num_output_placeholders
    - 1`` (vLLM's own frontier, ``num_computed_tokens - num_output_placeholders``,
    plus the last sampled token, whose KV the step in flight writes).

    That KV is in the cache when the snapshot reads it: the steps before
    have finished (their sampled tokens were read back), and the step in
    flight queued its cache writes on the CUDA stream vLLM runs the model
    on, the current stream of the thread calling ``step()``, where the
    export then queues its gathers, after them (a CPU engine runs each step
    to its end). A prefill chunk in flight (no placeholders) is read so too.
    A linear-attention state block holds the state after every computed
    token, drafts included: consistent with this count because such models
    are refused with speculative decoding (``cache.unsupported_cache``).
    """
    computed = int(req.num_computed_tokens)
    placeholders = int(getattr(req, "num_output_placeholders", 0) or 0)
    committed = computed - max(placeholders - 1, 0)
    if committed < 0 or committed > num_tokens:
        raise HurrayFormatError(
            "request_id",
            f"request {rid!r} counts {computed} computed tokens ({placeholders} in flight) for {num_tokens} token "
            "ids: its committed tokens cannot be told apart; snapshot it after its next step",
        )
    return committed


def snapshot(llm: Any, request_ids: Sequence[str]) -> KVSnapshot:
    """Export the KV of live requests of an in-process ``vllm.LLM``.

    Args:
        llm: a ``vllm.LLM`` created with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
        request_ids: the ids given to ``llm.llm_engine.add_request``.

    Returns:
        A snapshot holding every computed token of each request (including a
        partly filled last block), their token ids (prompt and generated:
        the request's ``all_token_ids``), the model fingerprint, and the fp8
        scales of an fp8 cache. Mid-decode with synchronous scheduling the
        token ids are one longer than the KV: the last sampled token has no
        KV yet. Mid-decode with asynchronous scheduling the step in flight
        writes that token's KV, and the KV covers every token id; with
        speculative decoding the draft tokens of that step are not
        exported: only tokens in ``all_token_ids`` are.

    Call it between ``llm.llm_engine.step()`` calls. A worker in this
    process (vLLM's ``UniProcExecutor``, the default at tensor parallelism
    1) is read here. Workers in processes of their own (the ``"mp"`` or
    ``"ray"`` executor, at any TP) export on their ranks, and the snapshot
    joins their KV heads in model order: each distinct run of heads comes
    from one rank, and a rank whose heads another rank exports (replicated
    heads, fewer KV heads than ranks; an MLA latent or a single KV head,
    which every rank holds) sends no KV, only its share of a linear-attention
    hybrid's states. It equals the snapshot of the same requests at TP = 1,
    within the arithmetic's rounding (``tests/adapters/vllm/test_tp.py``).
    A rank's error reaches the caller as in this process (the same
    :class:`HurrayFormatError` and ``field``, or ``OSError``; another
    exception as ``RuntimeError``), every rank answering, and ranks that do
    not answer within :data:`WORKER_TIMEOUT_S` seconds raise
    ``TimeoutError`` (restart the engine then).

    In an engine running ``HurrayConnector``, each request's chunk key seed
    is the one its connector keys it by (``extra["hurray_vllm.key_seeds"]``,
    for ``store_snapshot``): after a cache reset (a weight update) a request
    holding KV from before the reset has none (``null``: no chunks), as the
    connector saves none of it.

    Raises:
        HurrayArgumentError: (field ``request_ids``) a ``str`` instead of a
            sequence of ids: pass ``[request_id]``; an id that is not a
            ``str`` (vLLM's ids are).
        HurrayFormatError: checked before any worker is asked:

            * ``request_id``: an unknown or finished request, a request of
              ``n > 1`` sampling (its children's tokens and KV differ), one
              still loading its KV through a connector
              (``WAITING_FOR_REMOTE_KVS``: snapshot it once its load
              finishes), one preempted (vLLM freed its KV: snapshot it after
              it resumes), or one whose computed tokens the tokens in flight
              do not explain (snapshot it after its next step);
            * ``kv_cache_groups``: a model whose KV cache hurray-vllm cannot
              export (an encoder-decoder's cross attention, a pure state
              space model, ...: :func:`~.cache.unsupported_cache`), or a
              layer in none of the worker's KV cache groups;
            * ``engine``: the engine core is not in this process (start vLLM
              with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or export through
              ``HurrayConnector``);
            * ``pipeline_parallel_size``, ``decode_context_parallel_size``,
              ``prefill_context_parallel_size``: parallelism hurray-vllm does
              not handle; ``distributed_executor_backend``: the external
              launcher at TP > 1; ``tensor_parallel_size``: a
              linear-attention hybrid whose states cannot be split across
              the ranks (:func:`~.cache.split_states_refusal`);

            and found on a worker, raised as that worker raised it
            (:func:`~.cache.describe_worker_cache`): ``kv_cache_dtype`` (a
            cache dtype other than ``auto`` and fp8, or an fp8 this platform
            stores otherwise), ``cache`` (pages that are not a key and a
            value of the head size), ``layers`` (layers of different page
            geometries), ``block_size`` (a backend that cuts blocks into
            kernel blocks), ``kv_scales`` (per-head fp8 scales), ``isa``
            (layers packed for different CPU ISAs), ``block_ids`` (block ids
            outside the cache), ``snapshot.heads`` / ``snapshot.states`` (a
            rank's heads or states not its share).
        OSError: a weight file could not be read for the model's fingerprint
            (:func:`~.cache.weights_digest`), on a worker or here.
        RuntimeError: any other exception on a worker in another process, as
            ``"rank N: Type: message"`` (the worker's traceback in a note);
            a worker in this process raises its own exception.
        TimeoutError: workers in other processes did not answer within
            :data:`WORKER_TIMEOUT_S`.

    Example:
        Snapshot two requests mid-decode and save them (needs a model; the
        demo and ``tests/adapters/vllm/test_export.py`` run this):

        >>> import os, vllm, hurray_vllm as hv  # doctest: +SKIP
        >>> from hurray_vllm.adapters.vllm import snapshot  # doctest: +SKIP
        >>> os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # doctest: +SKIP
        >>> llm = vllm.LLM(model="/models/llama", enforce_eager=True)  # doctest: +SKIP
        >>> sp = vllm.SamplingParams(max_tokens=64)  # doctest: +SKIP
        >>> for rid, ids in {"a": [1, 2, 3], "b": [1, 2, 4]}.items():  # doctest: +SKIP
        ...     llm.llm_engine.add_request(rid, vllm.inputs.TokensPrompt(prompt_token_ids=ids), sp)
        >>> for _ in range(8):  # doctest: +SKIP
        ...     _ = llm.llm_engine.step()
        >>> hv.save(snapshot(llm, ["a", "b"]), "kv.hrry")  # doctest: +SKIP
    """
    why = unsupported_parallelism(llm.llm_engine.vllm_config.parallel_config)
    if why is not None:
        raise HurrayFormatError(why[0], f"snapshot() {why[1]}")
    ids = _request_ids(request_ids)  # read once: the seeds (_key_seeds) read the ids again
    return _snapshot(llm, ids, request_states(llm, ids))


def _snapshot(llm: Any, request_ids: Sequence[str], seqs: Sequence[SequenceState]) -> KVSnapshot:
    """:func:`snapshot` of ``seqs`` (:func:`request_states` of ``request_ids``)."""
    if _workers_here(llm):
        ec, groups = _cache_here(llm)
        snap = export_snapshot(ec.caches, ec.layout, seqs, **ec.export_options(), **groups, states=_states(ec, seqs))
    else:
        _refuse_split_states(llm, "snapshots")
        snap = _snapshot_tp(llm, seqs)
    extra = {**_key_seeds(llm, request_ids), **_drafter(llm, snap.num_layers)}
    return replace(snap, extra={**snap.extra, **extra}) if extra else snap


def _drafter(llm: Any, num_layers: int) -> dict[str, Any]:
    """``extra`` naming the model's own layers where the engine's speculative drafter has KV layers after them.

    EAGLE's head and DeepSeek's MTP layers keep their KV in the target's
    caches, so a snapshot holds them too; a model without the drafter takes
    the leading ones (:meth:`~hurray_vllm.kv.snapshot.KVSnapshot.without_drafter`).
    """
    target = target_layers(llm.llm_engine.vllm_config)
    return {TARGET_LAYERS: target} if num_layers > target else {}


def _key_seeds(llm: Any, request_ids: Sequence[str]) -> dict[str, Any]:
    """``extra`` recording the requests whose chunk keys are not plain (LoRA, salt, media, a reset); else empty.

    So that ``store_snapshot`` keys a snapshot's chunks as the connector keys
    the same requests (:data:`~hurray_vllm.chunks.keys.KEY_SEEDS`). An engine
    running :class:`~hurray_vllm.adapters.vllm.connector.HurrayConnector`
    gives each request the seed its connector keys it by (``_connector_seeds``):
    after a cache reset (a weight update) a request computed since has the
    reset's epoch in its seed, and one holding KV from before the reset has
    none (``null``: ``store_snapshot`` stores no chunks of it, as the
    connector saves none). Without one, seeded from the namespace such a
    connector would use (the model's fingerprint from its config, asked only
    when a request needs it).
    """
    from .connector.scheduler import request_seed

    core = _core(llm)
    internal = {rid: _internal_id(llm, core, rid) for rid in request_ids}
    connector = _connector_seeds(core, internal)
    if connector is not None:
        return {KEY_SEEDS: connector} if connector else {}
    requests = {rid: core.scheduler.requests[i] for rid, i in internal.items()}
    # Whether a request's seed is plain does not depend on the namespace: look before describing the engine.
    special = [rid for rid, r in requests.items() if request_seed("", r) != ""]
    if not special:
        return {}
    ns = namespace_of(fingerprint_of(llm.llm_engine.vllm_config, kv_cache_config=_kv_cache_config(llm)))
    return {KEY_SEEDS: {rid: request_seed(ns, requests[rid]) for rid in special}}


def _connector_seeds(core: Any, internal: dict[str, str]) -> dict[str, str | None] | None:
    """The seeds a HurrayConnector keys the requests by, where not its namespace; None: the engine has none.

    Its scheduler part holds each request's seed (``HurrayScheduler._reqs``),
    decided when it first saw the request and set to None by a cache reset
    for one holding KV from before it; a request it has not seen yet takes
    the seed it would be given now (the current ``_epoch``).
    """
    connector = getattr(core.scheduler, "connector", None)
    # Alone, or one of a MultiConnector's connectors.
    parts = [getattr(c, "_scheduler", None) for c in (connector, *(getattr(connector, "_connectors", None) or ()))]
    part = next((p for p in parts if isinstance(getattr(p, "_reqs", None), dict)), None)
    if part is None:
        return None
    ns: str = part._ns
    seeds: dict[str, str | None] = {}
    for rid, i in internal.items():
        seed = part.seed_of(core.scheduler.requests[i])
        if seed != ns:
            seeds[rid] = seed
    return seeds


def snapshot_stream(llm: Any, request_ids: Sequence[str], f: BinaryIO, *, progress: bool = False) -> int:
    """Like :func:`snapshot`, written to ``f`` as a Hurray stream, layer by layer.

    Memory: one layer's pages, plus, for a linear-attention hybrid, the
    recurrent states of the requests in every linear-attention layer
    (gathered before the first layer is written: the header describes them
    and they follow the layers). Where the workers run in processes of their
    own (the ``"mp"`` or ``"ray"`` executor, any tensor parallelism) the
    ranks' heads are joined first (:func:`snapshot`): memory is then the
    whole snapshot, and ``progress`` is ignored.

    ``f.write`` must not keep the object it is given (the :mod:`io`
    contract of ``write()``): layers reach it as memoryviews over reused
    gather buffers, which later layers and later exports (of other requests)
    overwrite; a sink that queues them must copy them first (see
    :func:`~.export.export_stream`).

    Args:
        llm: as for :func:`snapshot`.
        request_ids: as for :func:`snapshot` (a sequence, not one ``str``).
        f: a binary file object open for writing; written from its current
            position, not closed, not flushed.
        progress: show a per-layer progress bar on a terminal (a worker in
            this process only).

    Returns:
        The number of bytes written to ``f``.

    Raises:
        HurrayArgumentError: as :func:`snapshot`.
        HurrayFormatError: as :func:`snapshot`, each before anything is
            written; a worker's error (``block_ids``...) may come after the
            header and the first layers were written: ``f`` then holds no
            complete stream (write to a file of its own, e.g. through
            :func:`~hurray_vllm.containers.atomic.atomic_path`).
        OSError: ``f.write`` failed, or as :func:`snapshot`.
        RuntimeError: as :func:`snapshot`.
        TimeoutError: as :func:`snapshot`.

    Example:
        Stream two live requests to a file (needs a model and ``llm`` as in
        :func:`snapshot`; ``tests/vllm_engine_run.py`` runs this for
        ``tests/adapters/vllm/test_export.py``):

        >>> import hurray_vllm as hv  # doctest: +SKIP
        >>> from hurray_vllm.adapters.vllm import snapshot_stream  # doctest: +SKIP
        >>> with open("kv.hrrs", "wb") as f:  # doctest: +SKIP
        ...     written = snapshot_stream(llm, ["a", "b"], f)
        >>> hv.load("kv.hrrs").num_seqs  # doctest: +SKIP
        2
    """
    why = unsupported_parallelism(llm.llm_engine.vllm_config.parallel_config)
    if why is not None:
        raise HurrayFormatError(why[0], f"snapshot_stream() {why[1]}")
    ids = _request_ids(request_ids)  # read once: the seeds (_key_seeds) read the ids again
    seqs = request_states(llm, ids)  # refuses an unsupported model before any worker is asked
    if not _workers_here(llm):
        return write_stream(_snapshot(llm, ids, seqs), f)
    ec, groups = _cache_here(llm)
    return export_stream(
        f,
        ec.caches,
        ec.layout,
        seqs,
        **ec.export_options(),
        **groups,
        show_progress=progress,
        states=_states(ec, seqs),
        extra={**_key_seeds(llm, ids), **_drafter(llm, ec.fingerprint.num_layers)},
    )


def snapshot_ranks(llm: Any, request_ids: Sequence[str], directory: str | os.PathLike[str]) -> list[Path]:
    """Each tensor-parallel rank streams its own KV heads of the requests to a file of its own: no gather.

    Where :func:`snapshot` and :func:`snapshot_stream` bring every rank's KV
    into this process, here each rank's worker writes its heads from its own
    process, layer by layer (memory: one layer's pages per rank, plus a
    linear-attention hybrid's states of the requests, every such layer's, as
    for :func:`snapshot_stream`), as a Hurray
    stream whose header names the heads it holds (``"heads": {"start",
    "stop", "total"}``, ``docs/format.md`` 2.3d). pyhurray reads each file as
    an ordinary snapshot of that many heads; :func:`hurray_vllm.load` gives
    it with ``snap.heads`` set, and ``kv.heads.concat_heads`` of the loaded
    files, in the order returned, is :func:`snapshot`'s result.

    One file per distinct head range: a rank holding a replica of another's
    heads (fewer KV heads than ranks) writes nothing, and neither does any
    rank but 0 for an MLA latent or a single KV head, which every rank holds
    whole (that file has no ``heads``). At TP = 1 rank 0 writes everything.
    A linear-attention hybrid's file holds the rank's share of the states
    too (``states.part``, ``docs/format.md``); with fewer KV heads than
    ranks, whose states then lie on several ranks per head, use
    :func:`snapshot`.

    Args:
        llm: as for :func:`snapshot`.
        request_ids: as for :func:`snapshot`.
        directory: where the files go (created if missing), named
            ``rank{r}.hrrs`` or ``rank{r}.heads{start}-{stop}.hrrs``; each
            appears complete or not at all (written aside, then renamed).

    Returns:
        The files written, in head order.

    Raises:
        HurrayArgumentError: as :func:`snapshot`.
        HurrayFormatError: as :func:`snapshot`; a rank's error as that rank
            raised it (as :func:`snapshot`), once the files the other ranks
            wrote in this call are removed (with one rank's file missing the
            others are no snapshot). Files of an earlier call that a rank
            had not replaced yet stay: give each snapshot a directory of its
            own.
        OSError: a rank could not write its file (removed as above).
        RuntimeError: any other exception on a rank, as :func:`snapshot`
            (files removed as above: every rank answers).
        TimeoutError: as :func:`snapshot` (files are not removed: the ranks may still be writing).

    Example:
        >>> import hurray_vllm as hv  # doctest: +SKIP
        >>> from hurray_vllm.adapters.vllm import snapshot_ranks  # doctest: +SKIP
        >>> from hurray_vllm.kv.heads import concat_heads  # doctest: +SKIP
        >>> files = snapshot_ranks(llm, ["a", "b"], "/scratch/kv")  # doctest: +SKIP
        >>> [f.name for f in files]  # doctest: +SKIP
        ['rank0.heads0-4.hrrs', 'rank1.heads4-8.hrrs']
        >>> whole = concat_heads([hv.load(f) for f in files])  # doctest: +SKIP
    """
    why = unsupported_parallelism(llm.llm_engine.vllm_config.parallel_config)
    if why is not None:
        raise HurrayFormatError(why[0], f"snapshot_ranks() {why[1]}")
    ids = _request_ids(request_ids)  # read once: the seeds (_key_seeds) read the ids again
    seqs = request_states(llm, ids)
    _refuse_split_states(llm, "snapshot_ranks() files", per_rank=True)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    extra = {**_key_seeds(llm, ids), **_drafter(llm, cache_layers(_kv_cache_config(llm)) or 0)}
    results = _rpc(llm, _stream_on_rank, list(seqs), str(out), extra)
    files = [Path(p) for r in results if not isinstance(r, _WorkerError) and (p := r[1][1]) is not None]
    if any(isinstance(r, _WorkerError) for r in results):
        for f in files:  # the other ranks' files: without the failed rank's, they are no snapshot
            with contextlib.suppress(OSError):  # the worker's error is the one to report
                f.unlink()
        _raise_failed(results)
    written = dict(results)
    return [Path(p) for _, p in sorted((start, p) for start, p in written.values() if p is not None)]


def _stream_on_rank(
    worker: Any, seqs: Sequence[SequenceState], directory: str, extra: dict[str, Any]
) -> tuple[int, tuple[int, str | None]]:
    """Runs on every worker: this rank's heads of ``seqs`` streamed to its own file (none for a replica)."""
    from ...containers.atomic import atomic_path

    # States that do not split across ranks were refused in the caller (_refuse_split_states).
    rank = _tp_rank()
    heads, writes = rank_share(worker.vllm_config, rank)
    if not writes:
        return rank, (heads.start if heads is not None else 0, None)
    ec = _describe(worker)
    name = f"rank{rank}.hrrs" if heads is None else f"rank{rank}.heads{heads.start}-{heads.stop}.hrrs"
    with atomic_path(Path(directory) / name, fsync=False) as tmp, open(tmp, "wb") as f:
        export_stream(
            f,
            ec.caches,
            ec.layout,
            seqs,
            **ec.export_options(),
            **_worker_groups(worker, ec),
            heads=heads,
            states=_states(ec, seqs),
            extra=extra,
        )
    return rank, (heads.start if heads is not None else 0, str(Path(directory) / name))


def _states(ec: EngineCache, seqs: Sequence[SequenceState]) -> RecurrentStates | None:
    """A linear-attention hybrid's states of ``seqs``, after their computed tokens (``None`` for other models)."""
    st = ec.states
    if st is None:
        return None
    blocks = [{g: st.block_of(s.group_block_ids[g], s.num_computed) for g in st.state_group_ids} for s in seqs]
    return st.gather(blocks, [s.num_computed for s in seqs])
