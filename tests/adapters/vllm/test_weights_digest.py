"""The model's weights digest (part of the fingerprint and the store namespace), without an engine."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest

from hurray_vllm.adapters.vllm.cache import cache_layers, model_dir, weights_digest


def _config(model: str, download_dir: Path | None = None, revision: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=revision),
        load_config=SimpleNamespace(download_dir=str(download_dir) if download_dir else None),
    )


def _checkpoint(d: Path, weights: bytes) -> None:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "model.safetensors").write_bytes(weights)


def _hub_cache(cache: Path, repo: str, commit: str, weights: bytes) -> None:
    """The layout huggingface_hub leaves behind: models--org--name/{refs/main, snapshots/<commit>/}."""
    base = cache / f"models--{repo.replace('/', '--')}"
    _checkpoint(base / "snapshots" / commit, weights)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)


def test_a_hub_id_is_digested_from_its_cached_snapshot_like_a_local_copy(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "local", b"w" * 200_000)
    _hub_cache(tmp_path / "hub", "org/tiny", "a" * 40, b"w" * 200_000)
    local = weights_digest(_config(str(tmp_path / "local")))
    hub = _config("org/tiny", tmp_path / "hub")
    assert model_dir(hub) == tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    assert weights_digest(hub) == local  # the same files, wherever they were loaded from


def test_other_weights_or_unknown_models_get_other_digests(tmp_path: Path) -> None:
    _hub_cache(tmp_path / "hub", "org/tiny", "a" * 40, b"w" * 200_000)
    _hub_cache(tmp_path / "hub", "org/tuned", "b" * 40, b"v" * 200_000)
    tiny = weights_digest(_config("org/tiny", tmp_path / "hub"))
    tuned = weights_digest(_config("org/tuned", tmp_path / "hub"))
    assert tiny != tuned
    # Not on this machine: named by id and revision, never shared with another model.
    ids = [("org/x", None), ("org/y", None), ("org/x", "v2")]
    absent = [weights_digest(_config(m, tmp_path / "hub", r)) for m, r in ids]
    assert model_dir(_config("org/x", tmp_path / "hub")) is None
    assert len({*absent, tiny, tuned}) == 5
    assert weights_digest(_config("org/x", tmp_path / "hub")) == absent[0]  # stable


def test_a_drafter_with_kv_layers_is_digested_after_the_model(tmp_path: Path) -> None:
    """EAGLE / MTP engines key chunks by the drafter's weights too: only engines with the same drafter share them."""
    _checkpoint(tmp_path / "target", b"t" * 1000)
    _checkpoint(tmp_path / "head-a", b"a" * 1000)
    _checkpoint(tmp_path / "head-b", b"b" * 1000)

    def engine(head: str) -> SimpleNamespace:
        cfg = _config(str(tmp_path / "target"))
        cfg.speculative_config = SimpleNamespace(method="eagle", draft_model_config=SimpleNamespace(model=head))
        return cfg

    alone = weights_digest(_config(str(tmp_path / "target")))
    a, b = engine(str(tmp_path / "head-a")), engine(str(tmp_path / "head-b"))
    assert weights_digest(a) == alone  # a drafter whose KV is not in the chunks (drafter=False) changes nothing
    assert len({alone, weights_digest(a, drafter=True), weights_digest(b, drafter=True)}) == 3
    assert weights_digest(a, drafter=True) == weights_digest(engine(str(tmp_path / "head-a")), drafter=True)


def test_cache_layers_counts_the_kv_layers_of_every_group_but_states() -> None:
    def group(spec: str, n: int) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_spec=type(spec, (), {})(), layer_names=[f"{spec}.{i}" for i in range(n)])

    eagle = SimpleNamespace(kv_cache_groups=[group("FullAttentionSpec", 3)])
    hybrid = SimpleNamespace(kv_cache_groups=[group("FullAttentionSpec", 2), group("MambaSpec", 6)])
    assert cache_layers(eagle) == 3 and cache_layers(hybrid) == 2
    assert cache_layers(None) is None and cache_layers(SimpleNamespace(kv_cache_groups=[])) is None


def test_what_the_engine_changes_about_the_checkpoint_is_digested_too(tmp_path: Path) -> None:
    """Same files, other KV: a rope override, a config from elsewhere, a quantization of a bf16 checkpoint."""
    _checkpoint(tmp_path / "m", b"w" * 1000)
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "config.json").write_text('{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}')

    def engine(**fields: object) -> SimpleNamespace:
        cfg = _config(str(tmp_path / "m"))
        vars(cfg.model_config).update(fields)
        return cfg

    plain = weights_digest(_config(str(tmp_path / "m")))
    assert weights_digest(engine(hf_overrides={}, quantization=None, hf_config_path=None)) == plain  # unchanged
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    changed = [
        weights_digest(engine(hf_overrides=yarn)),
        weights_digest(engine(hf_overrides={"rope_theta": 1e6})),
        weights_digest(engine(hf_config_path=str(tmp_path / "long"))),
        weights_digest(engine(quantization="fp8")),
        weights_digest(engine(quantization="fp8", quantization_config={"ignore": ["lm_head", "layers.0"]})),
    ]
    # Random weights ("dummy") or weights streamed from elsewhere: not the files digested.
    dummy = _config(str(tmp_path / "m"))
    dummy.load_config.load_format = "dummy"
    streamed = _config(str(tmp_path / "m"))
    streamed.load_config.load_format = "runai_streamer"
    streamed.model_config.model_weights = "s3://bucket/tuned"
    changed += [weights_digest(dummy), weights_digest(streamed)]
    # LongRoPE picks its rotation by the context length the engine allows.
    longrope = {"rope_type": "longrope", "original_max_position_embeddings": 4096}
    changed += [
        weights_digest(engine(hf_config=SimpleNamespace(rope_parameters=longrope), max_model_len=4096)),
        weights_digest(engine(hf_config=SimpleNamespace(rope_parameters=longrope), max_model_len=131072)),
    ]
    assert len({plain, *changed}) == 10
    same_format = _config(str(tmp_path / "m"))
    same_format.load_config.load_format = "safetensors"
    assert weights_digest(same_format) == plain  # the files digested are the weights'
    assert weights_digest(engine(hf_config=SimpleNamespace(rope_parameters={"rope_type": "yarn"}))) == plain
    assert weights_digest(engine(hf_overrides=dict(reversed(list(yarn.items()))))) == changed[0]  # stable


def _weights_dir(d: Path, name: str, data: bytes) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / name).write_bytes(data)
    return d


def test_checkpoints_differing_only_in_a_middle_tensor_get_other_digests(tmp_path: Path) -> None:
    """A LoRA merged into the middle layers, or a fine-tune with frozen edge layers: the files' first and last
    64 KiB (all that was digested before) are the same, so the two models shared one namespace, and loaded each
    other's KV."""
    import torch
    from safetensors.torch import save

    gen = torch.Generator().manual_seed(0)
    base = {f"layers.{i}.weight": torch.randn(256, 256, generator=gen).to(torch.bfloat16) for i in range(5)}
    lora_b, lora_a = 0.1 * torch.randn(256, 4, generator=gen), torch.randn(4, 256, generator=gen)
    merged = {**base, "layers.2.weight": (base["layers.2.weight"].float() + lora_b @ lora_a).to(torch.bfloat16)}
    files = [save(base), save(base), save(merged)]
    ends = 64 << 10
    assert len(files[0]) == len(files[2]) and len(files[0]) > 4 * ends
    assert files[0][:ends] == files[2][:ends] and files[0][-ends:] == files[2][-ends:]  # the premise
    digests = [
        weights_digest(_config(str(_weights_dir(tmp_path / str(i), "model.safetensors", data))))
        for i, data in enumerate(files)
    ]
    assert digests[0] == digests[1] and digests[2] != digests[0]


def test_other_weight_files_are_sampled_at_their_ends_and_evenly_between(tmp_path: Path) -> None:
    """A ``.bin`` (pickled) checkpoint is not parsed: a change in a sampled span is seen, a change between the
    spans is not (a limit docs/connector.md states: such checkpoints are told apart by 64 samples)."""
    import random

    from hurray_vllm.adapters.vllm import cache

    size = 8 << 20
    data = random.Random(0).randbytes(size)
    spans = cache._byte_ranges(size)
    assert spans[0] == (0, 64 << 10) and spans[-1] == (size - (64 << 10), size) and len(spans) == 66
    assert all(a[1] <= b[0] for a, b in pairwise(spans))  # in order, never overlapping
    assert sum(b - a for a, b in spans) == (128 + 64 * 4) << 10  # bounded, however large the file

    def digest(name: str, at: int | None) -> str:
        changed = bytearray(data)
        if at is not None:
            changed[at] ^= 1
        return weights_digest(_config(str(_weights_dir(tmp_path / name, "pytorch_model.bin", bytes(changed)))))

    plain = digest("plain", None)
    assert digest("again", None) == plain
    assert digest("sampled", spans[33][0] + 100) != plain  # inside a sample in the middle of the file
    assert digest("between", (spans[32][1] + spans[33][0]) // 2) == plain  # not read: not told apart
    small = cache._byte_ranges(100_000)
    assert small == [(0, 100_000)]  # a small file (config.json, a small adapter) is read whole


def test_a_file_named_safetensors_that_does_not_parse_is_sampled_as_bytes(tmp_path: Path) -> None:
    """A header longer than the file, not JSON, or with offsets past the end: sampled as any other file."""
    import json
    import struct

    from hurray_vllm.adapters.vllm import cache

    def header(obj: object, tail: bytes = b"\0" * 64) -> bytes:
        raw = json.dumps(obj).encode()
        return struct.pack("<Q", len(raw)) + raw + tail

    bad = [
        b"w" * 200_000,  # a header length of 0x7777... bytes
        struct.pack("<Q", 10) + b"not json!!" + b"\0" * 64,
        header([1, 2]),
        header({"t": {"dtype": "BF16", "shape": [32], "data_offsets": [0, 65]}}),  # one byte past the end
        header({"t": {"dtype": "BF16", "shape": [32], "data_offsets": [0, True]}}),
    ]
    for i, data in enumerate(bad):
        path = tmp_path / f"{i}.safetensors"
        path.write_bytes(data)
        with open(path, "rb") as f:
            assert cache._safetensors_ranges(f.fileno(), len(data)) is None, data[:40]
        assert weights_digest(_config(str(_weights_dir(tmp_path / str(i), "model.safetensors", data))))
    good = header({"__metadata__": {"format": "pt"}, "t": {"dtype": "BF16", "shape": [32], "data_offsets": [0, 64]}})
    (tmp_path / "good.safetensors").write_bytes(good)
    with open(tmp_path / "good.safetensors", "rb") as f:
        assert cache._safetensors_ranges(f.fileno(), len(good)) == [(0, len(good))]  # header and its one tensor


def test_the_digest_is_remembered_until_a_weight_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every snapshot describes the cache on every rank: the files are read once, not per call; a file replaced,
    rewritten or touched (its inode, size or modification time) is read again."""
    import os

    from hurray_vllm.adapters.vllm import cache

    d = _weights_dir(tmp_path / "m", "pytorch_model.bin", b"w" * 300_000)
    reads = {"n": 0}
    pread = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        reads["n"] += 1
        return pread(fd, n, offset)

    monkeypatch.setattr(cache.os, "pread", counting)
    config = _config(str(d))
    first = weights_digest(config)
    assert reads["n"] > 0
    reads["n"] = 0
    assert [weights_digest(config) for _ in range(3)] == [first] * 3
    assert reads["n"] == 0  # remembered
    assert weights_digest(config, drafter=True) == first  # no drafter: the same inputs, the same entry
    st = (d / "pytorch_model.bin").stat()
    (d / "pytorch_model.bin").write_bytes(b"v" * 300_000)  # same size, in place
    os.utime(d / "pytorch_model.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    changed = weights_digest(config)
    assert changed != first and reads["n"] > 0
    (d / "pytorch_model.bin").unlink()
    (d / "pytorch_model.bin").write_bytes(b"w" * 300_000)  # the old bytes again, in a new file
    assert weights_digest(config) == first
    # What the engine changes beyond the files is part of what is remembered.
    config.model_config.hf_overrides = {"rope_theta": 1e6}
    assert weights_digest(config) not in (first, changed)
    config.model_config.hf_overrides = None
    assert weights_digest(config) == first


def test_the_remembered_digests_are_bounded(tmp_path: Path) -> None:
    from hurray_vllm.adapters.vllm import cache

    for i in range(cache._DIGESTS_MAX + 5):
        weights_digest(_config(f"org/absent-{i}", tmp_path / "hub"))
    assert len(cache._DIGESTS) <= cache._DIGESTS_MAX
