"""Stand-ins for the vLLM pieces the connector tests share (no engine needed).

The connector's modules as fixtures, a VllmConfig and KV cache configs as far
as the connector reads them, a bare HurrayWorker whose exports are stubbed, a
linear-attention scheduler, and counters of the chunk files a scheduler reads.
A worker that loads into caches a test builds is ``bare_worker.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import require

__all__ = [
    "backend_spec",
    "bare_push_worker",
    "conn",
    "counting_headers",
    "counting_reads",
    "kv_groups",
    "linear_scheduler",
    "meta",
    "vllm_config",
    "worker_config",
]


@pytest.fixture(scope="module")
def conn() -> ModuleType:
    """The connector's worker module (``hurray_vllm.adapters.vllm.connector.worker``)."""
    require("vllm")
    import hurray_vllm.adapters.vllm.connector.worker as c

    return c


@pytest.fixture(scope="module")
def meta() -> ModuleType:
    """The connector's metadata module (``hurray_vllm.adapters.vllm.connector.metadata``)."""
    require("vllm")
    import hurray_vllm.adapters.vllm.connector.metadata as m

    return m


def vllm_config(
    extra: dict[str, object], block_size: int = 16, tp: int = 1, role: str = "kv_both", pp: int = 1
) -> SimpleNamespace:
    """A VllmConfig as far as ``HurrayConfig.from_vllm`` reads it: the connector's extra config, blocks, TP, PP."""
    require("vllm")
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="HurrayConnector", kv_role=role, kv_connector_extra_config=extra)
    return SimpleNamespace(
        kv_transfer_config=kv,
        cache_config=SimpleNamespace(block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )


def bare_push_worker(conn: ModuleType, meta: ModuleType, tmp_path: Any, sender: Any) -> Any:
    """A HurrayWorker without an engine that saves and pushes through ``sender`` (any stand-in, or None).

    Its exports are stubbed: 4 tokens per block, one head of 8.
    """
    from hurray_vllm import KVSnapshot, ModelFingerprint
    from hurray_vllm.adapters.vllm.export import GatherBuffers
    from hurray_vllm.chunks.store import DirectoryStore
    from hurray_vllm.kv.paged import BlockPagedTensor

    c = object.__new__(conn.HurrayWorker)
    c._store, c._ns, c._url, c.stats = DirectoryStore(tmp_path), "ab" * 8, "nixl://127.0.0.1:1", meta.ConnectorStats()
    c._pushed, c._chunk_buffers, c._registered, c._sender = conn.OrderedDict(), [], [], sender
    c._push_paused_until, c._ask_paused_until, c._windows, c._inflight = 0.0, 0.0, (), set()
    c._unpushed, c._push_backoff, c._closing = conn.OrderedDict(), conn.PUSH_BACKOFF_S, False
    c._cut_short, c._failed_steps, c._steps_in_flight, c._tp = False, 0, 1, 1
    c._writer, c._staging = conn._Writer(1 << 30), conn._Staging(1 << 30)
    c._saves_here, c._my_heads = True, None  # TP = 1
    c._shares_states = False  # no states gathered across ranks
    c._keys = None  # an unkeyed fleet
    c._fingerprint = ModelFingerprint("T", 1, 1, 8, "bfloat16")

    def export(ec, caches, task, block_ids, reuse=False, states=None):  # type: ignore[no-untyped-def]
        assert reuse
        if not c._chunk_buffers:
            c._chunk_buffers = [GatherBuffers()]
        k, v = c._chunk_buffers[0].take((len(block_ids), 4, 1, 8), torch.bfloat16, torch.device("cpu"))
        k.fill_(float(len(getattr(sender, "calls", ())))), v.fill_(1.0)
        n = 4 * len(block_ids)
        idx = (torch.arange(len(block_ids)), torch.tensor([0, len(block_ids)]), torch.tensor([n]))
        return KVSnapshot(
            (BlockPagedTensor(k, *idx, "key", 0),),
            (BlockPagedTensor(v, *idx, "value", 0),),
            token_ids=(tuple(task.tokens),),
            fingerprint=ModelFingerprint("T", 1, 1, 8, "bfloat16"),
        )

    c._export_chunk = export
    ec = SimpleNamespace(caches=[torch.zeros((16, 4))], states=None)
    c._engine_cache, c._ec = (lambda: ec), ec
    return c


def linear_scheduler(tmp_path: Any) -> Any:
    """A scheduler for a linear-attention hybrid: two state groups (align mode) and a full group, blocks of 32."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.chunks.store import DirectoryStore

    mamba = type(
        "MambaSpec",
        (),
        {
            "block_size": 32,
            "mamba_cache_mode": "align",
            "mamba_type": "gdn_attn",
            "shapes": ((3, 16), (2, 4, 8)),
            "dtypes": (torch.bfloat16, torch.bfloat16),
        },
    )
    full = type("FullAttentionSpec", (), {"block_size": 32, "sliding_window": None})
    kv = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=mamba(), layer_names=["model.layers.0.linear_attn"]),
            SimpleNamespace(kv_cache_spec=mamba(), layer_names=["model.layers.1.linear_attn"]),
            SimpleNamespace(kv_cache_spec=full(), layer_names=["model.layers.2.self_attn.attn"]),
        ]
    )
    vc = vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": 64}, block_size=32)
    vc.cache_config.mamba_cache_mode = "align"
    cfg = HurrayConfig.from_vllm(vc, kv)  # type: ignore[arg-type]
    assert cfg.state_groups == (0, 1) and cfg.state_mode == "align" and cfg.group_windows == (None, None, None)
    layout = cfg.state_layout
    assert layout is not None and layout.kind == "gdn_attn" and layout.layers == (0, 1) and layout.attention == (2,)
    # The format's recurrent state is [v_heads, k_dim, v_dim]: vLLM declares [v_heads, v_dim, k_dim].
    assert layout.shapes == ((3, 16), (2, 8, 4)) and layout.dtype_names == ("bfloat16", "bfloat16")
    return HurrayScheduler(cfg, DirectoryStore(tmp_path), None, "ab" * 8)  # type: ignore[arg-type]


def counting_reads(sched: Any) -> list[str]:
    """A list of the chunk files ``sched`` reads (or takes from the verified-chunk cache) from now on."""
    read: list[str] = []
    real = sched._read_parts

    def counted(parts: Any, tokens: Any, reader: Any = None) -> Any:
        read.extend(p.name for p in parts)
        return real(parts, tokens, reader)

    sched._read_parts = counted
    return read


def counting_headers(monkeypatch: pytest.MonkeyPatch, fail: dict[str, int] | None = None) -> list[str]:
    """A list of the chunk files whose headers schedulers read from now on (file names).

    ``fail``: by file name, how many reads fail first with EMFILE (out of descriptors: the process ran short, the
    file is fine).
    """
    import errno

    from hurray_vllm.adapters.vllm.connector import scheduler
    from hurray_vllm.chunks import store

    headers: list[str] = []
    real = store.read_header

    def read_header(path: Path, **kwargs: Any) -> Any:
        headers.append(path.name)
        if fail and fail.get(path.name, 0) > 0:
            fail[path.name] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, **kwargs)

    for module in (scheduler, store):  # the scheduler's own reads, and DirectoryStore.header's
        monkeypatch.setattr(module, "read_header", read_header, raising=False)
    return headers


def backend_spec(name: str, heads: int, monkeypatch: pytest.MonkeyPatch, *, window: int | None = None) -> object:
    """The KV cache spec vLLM 0.32 gives a layer of backend ``name`` (its ``customize_spec``; all import on CPU)."""
    require("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if name == "B12X":
        from vllm.v1.attention.backends.b12x import B12xPagedAttentionBackend as backend
    elif name == "ROCM_ATTN":
        from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend as backend
    elif name == "ROCM_SEGMENTED_ATTN":
        from vllm.v1.attention.backends.rocm_segmented_attn import RocmSegmentedAttentionBackend as backend
    elif name == "ROCM_AITER_UNIFIED_ATTN":
        from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionBackend as backend
    elif name == "TRITON_ATTN":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend as backend
    elif name == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as backend
    else:  # ROCM_AITER_FA, with VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=1 ("_SHUFFLE") or without
        from vllm.v1.attention.backends import rocm_aiter_fa

        shuffle = name.endswith("_SHUFFLE")
        monkeypatch.setattr(rocm_aiter_fa.rocm_aiter_ops, "is_shuffle_kv_cache_enabled", lambda: shuffle)
        backend = rocm_aiter_fa.AiterFlashAttentionBackend
    kv = {"block_size": 16, "num_kv_heads": heads, "head_size": 8, "dtype": torch.bfloat16}
    spec = SlidingWindowSpec(sliding_window=64, **kv) if window else FullAttentionSpec(**kv)
    return backend.customize_spec(spec)


def kv_groups(*specs: object) -> object:
    """A KVCacheConfig as far as ``unsupported_cache`` reads it: one layer per spec, one group each."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])


def worker_config(
    caches: list[torch.Tensor], head_dim: int, impl: str, *, cache_dtype: str = "auto"
) -> tuple[object, list[str]]:
    """A vLLM config as far as ``describe_worker_cache`` reads it, one attention layer per cache."""
    from types import SimpleNamespace as NS

    backend = type(impl, (), {})  # a name starting with "CPU": the packed CPU layout; any other: LogicalBHNC
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(caches))]
    layers = {n: NS(kv_cache=[c], impl=backend(), isa="vec") for n, c in zip(names, caches, strict=True)}
    heads = int(caches[0].shape[1])
    model = NS(
        use_mla=False,
        dtype=torch.bfloat16,
        get_head_size=lambda: head_dim,
        get_total_num_kv_heads=lambda: heads,
        get_num_layers=lambda pc: len(caches),
        hf_config=NS(architectures=["LlamaForCausalLM"]),
        model="/nonexistent",
        revision=None,
        is_hybrid=False,
    )
    config = NS(
        model_config=model,
        cache_config=NS(cache_dtype=cache_dtype, block_size=int(caches[0].shape[2]), kv_cache_layout=None),
        compilation_config=NS(static_forward_context=layers),
        parallel_config=NS(tensor_parallel_size=1),
        load_config=NS(load_format="auto", download_dir=None),
        speculative_config=None,
    )
    return config, names
