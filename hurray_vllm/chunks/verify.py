"""The checks a consumer runs on a stored or received chunk before it uses any of its KV.

Two parts, run in this order by every consumer (the connector's scheduler
and worker, the receivers, ``hurray-vllm validate`` and ``fsck``):

* :func:`verify_chunk`: the chunk is this model's KV of exactly the tokens
  its key promises, holding the heads its file name says;
* :func:`check_data`: its bytes are intact, and with a fleet key
  (:mod:`.signing`) they were written by a holder of the key for this very
  namespace and name. The MAC covers what the checksum covers, so a keyed
  consumer checks the MAC instead of the checksum, not on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..containers.hrryfile import FileBytes
from ..errors import HurrayArgumentError, HurrayFormatError
from ..kv.snapshot import KVSnapshot, ModelFingerprint
from ..wire import dtypes
from .digest import begin_digest_check, check_heads
from .keys import namespace_of
from .signing import FleetKeys, begin_signature_check

__all__ = ["begin_check_data", "check_data", "verify_chunk"]


def check_data(snap: KVSnapshot, keys: FleetKeys | None = None, namespace: str = "", name: str = "") -> None:
    """Raise :class:`HurrayFormatError` unless ``snap``'s bytes are intact (and, with ``keys``, signed for its name).

    Args:
        snap: The chunk, as read or received.
        keys: The consumer's fleet keys; ``None``: only the chunk digest is checked.
        namespace: The chunk's namespace (its store directory).
        name: Its file name in the store, without ``.hrry`` (a slice's includes its heads).

    Raises:
        HurrayFormatError: field ``snapshot.digest`` (damaged, or no or an old digest), or
            one of :mod:`.signing`'s refusals (``snapshot.mac.unsigned``, ``snapshot.mac.key_id``,
            ``snapshot.mac``).
        HurrayArgumentError: ``keys`` without ``namespace`` or ``name`` (fields ``namespace``, ``name``): the MAC
            is bound to both, so it cannot be checked without them.
    """
    begin_check_data(snap, keys, namespace, name)()


def _mac_binding(keys: FleetKeys | None, namespace: str, name: str) -> None:
    """Raise :class:`HurrayArgumentError` if a MAC would be checked under ``keys`` without its namespace or name.

    The MAC is bound to both: checked against an empty one it never matches, and a good chunk would be
    refused as forged (``snapshot.mac``, which consumers count as damage) for the caller's omission.
    """
    if keys is None:
        return
    for arg, value, what in (
        ("namespace", namespace, "the store directory the chunk was read from"),
        ("name", name, "its file name in the store, without .hrry (a slice's with its heads)"),
    ):
        if not value:
            raise HurrayArgumentError(
                arg, f"with fleet keys a chunk's MAC is checked for its namespace and file name: pass {arg}=, {what}"
            )


def begin_check_data(
    snap: KVSnapshot,
    keys: FleetKeys | None = None,
    namespace: str = "",
    name: str = "",
    read: FileBytes | None = None,
) -> Callable[[], None]:
    """:func:`check_data` in two halves: the header now, the page pools in the callable returned.

    The callable is native work that releases the GIL (one CRC-32C call, or
    one call feeding OpenSSL's Poly1305 every pool): run it on a helper thread to
    overlap the pools' check with other work, such as reading the next
    chunk. It raises as :func:`check_data` does for data that does not
    match; a missing, old or foreign digest or MAC raises now. ``read``: the
    file ``snap`` was parsed from, read with page checksums
    (:func:`~hurray_vllm.chunks.digest.begin_digest_check`).

    Example:
        >>> from hurray_vllm.app.demo import spec_example_snapshot
        >>> from hurray_vllm.chunks import chunks_of
        >>> ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
        >>> rest = begin_check_data(chunk)
        >>> rest()  # the page pools match the digest: no error
    """
    if keys is not None:
        _mac_binding(keys, namespace, name)
        return begin_signature_check(snap, keys, namespace, name)
    return begin_digest_check(snap, read)


def verify_chunk(
    snap: KVSnapshot,
    fp: ModelFingerprint,
    tokens: Sequence[int],
    *,
    digest: bool = True,
    heads: range | None = None,
    keys: FleetKeys | None = None,
    namespace: str = "",
    name: str = "",
) -> None:
    """Raise :class:`HurrayFormatError` unless ``snap`` is this model's KV of exactly ``tokens``.

    ``digest=False`` leaves out the data check (:func:`check_data`: the
    caller runs it itself, e.g. on another thread). ``heads``: the KV heads
    the file must hold (a tensor-parallel slice's, as its name says).
    ``keys``, ``name``: see :func:`check_data` (with ``keys`` and ``digest``,
    ``name`` is required). ``namespace``: the store
    directory the chunk was read from (also what its MAC covers); empty:
    ``fp``'s own (:func:`~.keys.namespace_of`), the directory a consumer of
    model ``fp`` reads. The chunk's fingerprint must name that namespace.

    Raises:
        HurrayArgumentError: ``keys`` and ``digest`` without ``name`` (field ``name``), before any check.
    """
    want = namespace or namespace_of(fp)
    if digest:
        _mac_binding(keys, want, name)
    if snap.fingerprint is None:
        raise HurrayFormatError("snapshot.fingerprint", "chunk carries no model fingerprint")
    diffs = snap.fingerprint.mismatches(fp)
    if diffs:
        raise HurrayFormatError("snapshot.fingerprint", "chunk is from another model: " + "; ".join(diffs))
    # mismatches() lets a side without a weights digest match any digest: a chunk written by an engine
    # that had none (or had another) and copied into this model's directory would pass it. Its own
    # namespace says which model's directory it belongs in, as the receivers and fsck check.
    has = namespace_of(snap.fingerprint)
    if has != want:
        raise HurrayFormatError(
            "snapshot.fingerprint",
            f"chunk is another model's (namespace {has}, weights digest {snap.fingerprint.weights_digest!r}), "
            f"read from namespace {want}",
        )
    if snap.num_seqs != 1 or snap.seq_lens != [len(tokens)]:
        raise HurrayFormatError("seq_lens", f"chunk holds {snap.seq_lens} tokens, expected [{len(tokens)}]")
    _check_token_ids(snap, len(tokens))
    if list(snap.token_ids[0]) != list(tokens):
        raise HurrayFormatError("snapshot.token_ids", "chunk holds other tokens than its key promises")
    if heads is not None and not snap.is_latent:
        check_heads(snap, heads)
    _check_geometry(snap, fp, heads)
    if digest:
        check_data(snap, keys, want, name)  # the namespace resolved, which the MAC is bound to


def _check_token_ids(snap: KVSnapshot, count: int) -> None:
    """Raise unless ``snap`` carries the token ids of one sequence, exactly ``count`` of them.

    Token ids are optional in a snapshot, so the loader takes a one-sequence
    file without them: as a chunk it would promise KV of no tokens at all
    (its key's tokens cannot be checked against it), and a consumer indexing
    them would fail with an ``IndexError`` no caller expects. A chunk holds
    the ids of its KV's tokens and no more (:func:`~.keys.chunks_of`).
    """
    lens = [len(ids) for ids in snap.token_ids]
    if lens != [count]:
        raise HurrayFormatError(
            "snapshot.token_ids", f"chunk carries token ids of lengths {lens}, expected one sequence's {count}"
        )


def _check_geometry(snap: KVSnapshot, fp: ModelFingerprint, heads: range | None) -> None:
    """Raise unless the chunk's pools are what its (matching) fingerprint says: layers, heads, head size, dtype.

    The fingerprint is the file's word, and its checksum covers the pools
    as they are: a file whose pools disagree with it (a faulty producer)
    would pass both and fail only as its blocks are written, which stops
    an engine. Refused as the fingerprint's mismatch is (field
    ``snapshot.fingerprint``): left in place, not moved aside as damage.

    A quantized tensor (a descriptor quantization section, or quantization
    parameter buffers after the three block-paged ones) is refused too
    (field ``quantization``): no importer reads those parameters, and the
    chunk digest and MAC do not cover their buffers (:func:`~.digest.digest_header`),
    so nothing that relies on them may pass as checked.
    """
    for t in snap.tensors():
        if t.quantization is not None or t.quant_buffers:
            raise HurrayFormatError(
                "quantization",
                f"layer {t.layer_index} {t.kv_role} is quantized ({type(t.quantization).__name__}, "
                f"{len(t.quant_buffers)} parameter buffers): chunks carry unquantized pools (an fp8 cache's scales "
                "go in kv_scales), and the chunk digest does not cover quantization parameters",
            )
    if snap.num_layers != fp.num_layers:
        raise HurrayFormatError(
            "snapshot.fingerprint", f"chunk holds {snap.num_layers} layers, its model {fp.num_layers}"
        )
    want = len(heads) if heads is not None and not snap.is_latent else fp.num_kv_heads
    for t in snap.tensors():
        dtype = dtypes.from_torch(t.dtype).name
        if (t.num_heads, t.head_dim, dtype) != (want, fp.head_dim, fp.dtype):
            raise HurrayFormatError(
                "snapshot.fingerprint",
                f"layer {t.layer_index} {t.kv_role} holds {t.num_heads} heads x {t.head_dim} {dtype}, its model "
                f"{want} x {fp.head_dim} {fp.dtype}",
            )
