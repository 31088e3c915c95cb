"""Snapshots of live requests in an in-process ``vllm.LLM``.

Drive the engine step by step (``llm.llm_engine.add_request(...)``,
``llm.llm_engine.step()``) and call :func:`snapshot` between steps: the
engine is single-threaded in-process, so between two ``step()`` calls no
forward pass is writing the cache and the snapshot is consistent.

Requires ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in this
process). For engines in other processes or servers, use the KV connector.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ...chunks.keys import KEY_SEEDS, namespace_of
from ...containers.io import write_stream
from ...errors import HurrayFormatError
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
    with_rank_heads,
)
from .export import SequenceState, export_snapshot, export_stream

__all__ = ["snapshot", "snapshot_ranks", "snapshot_stream", "engine_cache", "request_states", "layer_caches"]


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


def layer_caches(vllm_config: Any) -> tuple[list[str], list[torch.Tensor]]:
    """Attention layer names and their cache tensors, in model order."""
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


def engine_cache(llm: Any) -> EngineCache:
    """Describe the KV cache of an in-process ``vllm.LLM`` (its rank 0's at tensor parallelism > 1)."""
    _core(llm)
    ec: EngineCache = llm.collective_rpc(_describe)[0]
    return ec


def _tp(llm: Any) -> int:
    return int(getattr(llm.llm_engine.vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)


def _export_on_rank(worker: Any, seqs: Sequence[SequenceState]) -> tuple[int, KVSnapshot]:
    """Runs on every worker: this rank's KV heads of ``seqs`` (copied out of the cache, ready to pickle)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    ec = _describe(worker)  # states that do not split were refused in the caller (_refuse_split_states)
    config = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    groups = group_options(*cache_groups(config), ec.layer_names)
    snap = export_snapshot(ec.caches, ec.layout, seqs, **ec.export_options(), **groups, states=_states(ec, seqs))
    return int(get_tensor_model_parallel_rank()), with_rank_heads(snap, ec, worker.vllm_config)


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
    """Every rank exports its heads; one snapshot of them all, in model order (replicas and latents once)."""
    parts = dict(llm.collective_rpc(_export_on_rank, args=(list(seqs),)))
    first = parts[min(parts)]
    if first.is_latent:  # an MLA latent is on every rank
        return first
    states = None
    if first.states is not None:  # every rank's share, also where KV heads are replicated
        states = join_states([p.states for _, p in sorted(parts.items()) if p.states is not None])
        parts = {r: replace(p, states=None) for r, p in parts.items()}
    fp = first.fingerprint
    heads = fp.num_kv_heads if fp is not None else first.tensors()[0].num_heads * len(parts)
    joined = concat_heads([parts[r] for r in distinct_ranks(heads, len(parts))])
    return joined if states is None else replace(joined, states=states)


def _internal_id(llm: Any, core: Any, request_id: str) -> str:
    requests = core.scheduler.requests
    if request_id in requests:
        return request_id
    internal = llm.llm_engine.output_processor.external_req_ids.get(request_id, [])
    live = [i for i in internal if i in requests]
    if not live:
        raise HurrayFormatError(
            "request_id", f"no live request {request_id!r} in the engine (unknown, or already finished and freed)"
        )
    if len(live) > 1:
        raise HurrayFormatError("request_id", f"{request_id!r} names {len(live)} requests (n > 1 sampling)")
    return live[0]


def request_states(llm: Any, request_ids: Sequence[str]) -> list[SequenceState]:
    """Block ids, computed tokens and token ids of live requests (scheduler side)."""
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


def _group_options(llm: Any, ec: EngineCache) -> dict[str, Any]:
    """``layer_groups`` and ``group_windows`` for an engine with several KV cache groups (else none)."""
    config = _kv_cache_config(llm)
    return group_options(*cache_groups(config), ec.layer_names)


def snapshot(llm: Any, request_ids: Sequence[str]) -> KVSnapshot:
    """Export the KV of live requests of an in-process ``vllm.LLM``.

    Args:
        llm: a ``vllm.LLM`` created with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
        request_ids: the ids given to ``llm.llm_engine.add_request``.

    Returns:
        A snapshot holding every computed token of each request (including a
        partly filled last block), their token ids (prompt and generated;
        the last sampled token has no KV yet), the model fingerprint, and
        the fp8 scales of an fp8 cache. With asynchronous scheduling and
        speculative decoding, the draft tokens of the step in flight are
        not exported: only tokens in ``all_token_ids`` are.

    Call it between ``llm.llm_engine.step()`` calls. At tensor parallelism
    > 1 every rank exports its KV heads and the snapshot joins them in model
    order: replicated heads (fewer KV heads than ranks) and an MLA latent
    (on every rank) once. It equals the snapshot of the same requests at
    TP = 1, within the arithmetic's rounding (``tests/adapters/vllm/test_tp.py``).

    Raises:
        HurrayFormatError: (field ``request_id``) an unknown or finished
            request, or one still loading its KV through a connector
            (``WAITING_FOR_REMOTE_KVS``: snapshot it once its load finishes).

    Example:
        Snapshot two requests mid-decode and save them (needs a model; the
        demo and ``tests/adapters/vllm/test_export.py`` run this):

        >>> import os, vllm, hurray_vllm as hv  # doctest: +SKIP
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
    seqs = request_states(llm, request_ids)
    if _tp(llm) > 1:
        _refuse_split_states(llm, "snapshots")
        snap = _snapshot_tp(llm, seqs)
    else:
        ec = engine_cache(llm)
        snap = export_snapshot(
            ec.caches, ec.layout, seqs, **ec.export_options(), **_group_options(llm, ec), states=_states(ec, seqs)
        )
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
    """``extra`` recording the requests whose chunk keys are not plain (LoRA, ``cache_salt``, media); else empty.

    Seeded from the namespace the engine's connector uses (the model's
    fingerprint from its config, asked only when a request needs it).

    So that ``store_snapshot`` keys a snapshot's chunks as the connector keys
    the same requests (:data:`~hurray_vllm.chunks.keys.KEY_SEEDS`).
    """
    from .connector.scheduler import request_seed

    core = _core(llm)
    requests = {rid: core.scheduler.requests[_internal_id(llm, core, rid)] for rid in request_ids}
    # Whether a request's seed is plain does not depend on the namespace: look before describing the engine.
    special = [rid for rid, r in requests.items() if request_seed("", r) != ""]
    if not special:
        return {}
    ns = namespace_of(fingerprint_of(llm.llm_engine.vllm_config, kv_cache_config=_kv_cache_config(llm)))
    return {KEY_SEEDS: {rid: request_seed(ns, requests[rid]) for rid in special}}


def snapshot_stream(llm: Any, request_ids: Sequence[str], f: BinaryIO, *, progress: bool = False) -> int:
    """Like :func:`snapshot`, written to ``f`` layer by layer.

    Memory: one layer's pages, plus, for a linear-attention hybrid, the
    recurrent states of the requests in every linear-attention layer
    (gathered before the first layer is written: the header describes them
    and they follow the layers). ``progress=True`` shows a per-layer
    progress bar on a terminal. At tensor parallelism > 1 the ranks' heads
    are joined first: memory is then the whole snapshot.
    """
    why = unsupported_parallelism(llm.llm_engine.vllm_config.parallel_config)
    if why is not None:
        raise HurrayFormatError(why[0], f"snapshot_stream() {why[1]}")
    if _tp(llm) > 1:
        return write_stream(snapshot(llm, request_ids), f)
    ec = engine_cache(llm)
    seqs = request_states(llm, request_ids)
    return export_stream(
        f,
        ec.caches,
        ec.layout,
        seqs,
        **ec.export_options(),
        **_group_options(llm, ec),
        show_progress=progress,
        states=_states(ec, seqs),
        extra={**_key_seeds(llm, request_ids), **_drafter(llm, ec.fingerprint.num_layers)},
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
        HurrayFormatError: as :func:`snapshot`.

    Example:
        >>> files = snapshot_ranks(llm, ["a", "b"], "/scratch/kv")  # doctest: +SKIP
        >>> [f.name for f in files]  # doctest: +SKIP
        ['rank0.heads0-4.hrrs', 'rank1.heads4-8.hrrs']
        >>> whole = concat_heads([hv.load(f) for f in files])  # doctest: +SKIP
    """
    why = unsupported_parallelism(llm.llm_engine.vllm_config.parallel_config)
    if why is not None:
        raise HurrayFormatError(why[0], f"snapshot_ranks() {why[1]}")
    seqs = request_states(llm, request_ids)
    _refuse_split_states(llm, "snapshot_ranks() files", per_rank=True)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    extra = {**_key_seeds(llm, request_ids), **_drafter(llm, cache_layers(_kv_cache_config(llm)) or 0)}
    written = dict(llm.collective_rpc(_stream_on_rank, args=(list(seqs), str(out), extra)))
    return [Path(p) for _, p in sorted((start, p) for start, p in written.values() if p is not None)]


def _stream_on_rank(
    worker: Any, seqs: Sequence[SequenceState], directory: str, extra: dict[str, Any]
) -> tuple[int, tuple[int, str | None]]:
    """Runs on every worker: this rank's heads of ``seqs`` streamed to its own file (none for a replica)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from ...containers.atomic import atomic_path

    # States that do not split across ranks were refused in the caller (_refuse_split_states).
    rank = int(get_tensor_model_parallel_rank())
    heads, writes = rank_share(worker.vllm_config, rank)
    if not writes:
        return rank, (heads.start if heads is not None else 0, None)
    ec = _describe(worker)
    name = f"rank{rank}.hrrs" if heads is None else f"rank{rank}.heads{heads.start}-{heads.stop}.hrrs"
    config = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    with atomic_path(Path(directory) / name, fsync=False) as tmp, open(tmp, "wb") as f:
        export_stream(
            f,
            ec.caches,
            ec.layout,
            seqs,
            **ec.export_options(),
            **group_options(*cache_groups(config), ec.layer_names),
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
