"""The model's weights digest (part of the fingerprint and the store namespace), without an engine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

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
