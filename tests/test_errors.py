"""Which error type the importers raise: the caller's (``HurrayArgumentError``) or the data's (``HurrayFormatError``).

0.1 reported some caller errors of the importers as format errors. They are
now :class:`ImportArgumentError`, a ``HurrayArgumentError`` that is also a
``HurrayFormatError`` until 0.3 so that callers written against 0.1 still
catch them; genuine data errors stay format errors only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from synthetic import make_flashinfer_snapshot, make_snapshot

import hurray_vllm as hv
from hurray_vllm.adapters.flash_attn import plan_flash_attn, to_flash_attn, to_flash_attn_all
from hurray_vllm.adapters.flashinfer import plan_flashinfer, to_flashinfer, to_flashinfer_all
from hurray_vllm.errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError, Violation
from hurray_vllm.kv.repage import plan_repage, repage

Call = Callable[[], object]


def test_import_argument_error_is_both_and_exported() -> None:
    err = ImportArgumentError("plan", "made for another snapshot")
    assert isinstance(err, HurrayArgumentError) and isinstance(err, HurrayFormatError)
    assert isinstance(err, ValueError)
    assert err.field == "plan" and str(err) == "plan: made for another snapshot"
    assert err.violations == (Violation("plan", "made for another snapshot"),)
    assert hv.ImportArgumentError is ImportArgumentError and "ImportArgumentError" in hv.__all__


def _flash_attn_caller_errors() -> list[tuple[str, str, Call]]:
    snap = make_snapshot([40, 17], [0, 1], 16, layers=2)
    plan = plan_flash_attn(snap, page_size=256)
    other = make_snapshot([40], [0], 32, layers=1)
    good = torch.empty(plan.num_blocks, 256, 2, 16, dtype=torch.bfloat16)
    return [
        ("fa out count", "out", lambda: to_flash_attn_all(snap, out=[])),
        ("fa out not a pair", "out", lambda: to_flash_attn(snap, 0, plan=plan, out=(good,))),  # type: ignore[arg-type]
        ("fa out too small", "out[0]", lambda: to_flash_attn(snap, 0, plan=plan, out=(good[:0], good.clone()))),
        ("fa out device", "out", lambda: to_flash_attn(snap, 0, plan=plan, device="meta", out=(good, good.clone()))),
        ("fa plan other snapshot", "plan", lambda: to_flash_attn(other, 0, plan=plan)),
        ("fa plan other options", "plan", lambda: to_flash_attn(snap, 0, plan=plan, page_size=512)),
        ("fa dtype", "dtype", lambda: to_flash_attn(snap, 0, dtype=torch.float8_e4m3fn)),
        ("fa layer", "layer", lambda: to_flash_attn(snap, 2)),
    ]


def _flashinfer_caller_errors() -> list[tuple[str, str, Call]]:
    snap = make_flashinfer_snapshot([7, 3])
    k = snap.keys[0].page_pool
    one_seq = plan_repage(torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([3]), 4, 2)  # for 1 sequence, not 2
    return [
        ("fi out count", "out", lambda: to_flashinfer_all(snap, out=[])),
        ("fi out not a pair", "out", lambda: to_flashinfer(snap, 0, out=k.clone())),
        ("fi combined out not a tensor", "out", lambda: to_flashinfer(snap, 0, combined=True, out=(k, k))),
        ("fi out device", "out", lambda: to_flashinfer(snap, 0, device="meta", out=(k.clone(), k.clone()))),
        (
            "fi plan other snapshot",
            "plan",
            lambda: to_flashinfer(snap, 0, plan=plan_flashinfer(make_flashinfer_snapshot([7, 4]), 2)),
        ),
        ("fi plan other page size", "plan", lambda: to_flashinfer(snap, 0, page_size=8, plan=plan_flashinfer(snap, 2))),
        ("fi dtype", "dtype", lambda: to_flashinfer(snap, 0, dtype=torch.float8_e4m3fn)),
        ("fi layer", "layer", lambda: to_flashinfer(snap, 2)),
        ("repage page_size", "page_size", lambda: plan_flashinfer(snap, 0)),
        ("repage plan other batch", "plan", lambda: repage(snap.keys[0], 2, one_seq)),
    ]


CALLER_ERRORS = _flash_attn_caller_errors() + _flashinfer_caller_errors()


@pytest.mark.parametrize(("case", "field", "call"), CALLER_ERRORS, ids=[c[0] for c in CALLER_ERRORS])
def test_caller_errors_are_argument_errors_and_still_format_errors(case: str, field: str, call: Call) -> None:
    with pytest.raises(HurrayArgumentError) as err:
        call()
    assert isinstance(err.value, ImportArgumentError), (case, err.value)
    assert isinstance(err.value, HurrayFormatError), "0.1 callers catch HurrayFormatError (until 0.3)"
    assert err.value.field == field, (case, err.value)


def test_out_that_overlaps_the_snapshot_is_an_argument_error_only() -> None:
    # Never a format error, in 0.1 either: nothing to stay compatible with.
    fa = make_snapshot([40, 17], [0, 1], 16, layers=1)
    k, v = fa.keys[0].page_pool, fa.values[0].page_pool
    with pytest.raises(HurrayArgumentError) as err:
        to_flash_attn(fa, 0, page_size=16, flavor="fa3", out=(v, k))
    assert not isinstance(err.value, HurrayFormatError) and err.value.field == "out[0]"
    fi = make_flashinfer_snapshot([7, 3])
    with pytest.raises(HurrayArgumentError) as err:
        to_flashinfer(fi, 0, out=(fi.keys[0].page_pool.clone(), fi.values[0].page_pool))
    assert not isinstance(err.value, HurrayFormatError) and err.value.field == "out"


def _data_errors() -> list[tuple[str, str, Call]]:
    fa = make_snapshot([40, 17], [0, 0], 16, layers=1)
    moved = replace(fa.keys[0], block_table=fa.keys[0].block_table + 100)
    bad_ids = hv.KVSnapshot(keys=(moved,), values=(replace(fa.values[0], block_table=moved.block_table),))
    fi = make_flashinfer_snapshot([7, 3])
    ints = replace(
        fi,
        keys=tuple(replace(t, page_pool=t.page_pool.to(torch.int8)) for t in fi.keys),
        values=tuple(replace(t, page_pool=t.page_pool.to(torch.int8)) for t in fi.values),
    )
    return [
        ("fa empty snapshot", "snapshot", lambda: to_flash_attn_all(replace(fa, keys=(), values=()))),
        ("fa page ids outside the pool", "block_table", lambda: to_flash_attn(bad_ids, 0, page_size=16, flavor="vllm")),
        ("fi empty snapshot", "snapshot.layers", lambda: to_flashinfer_all(replace(fi, keys=(), values=()))),
        ("fi integer pool", "dtype", lambda: to_flashinfer(ints, 0)),
    ]


DATA_ERRORS = _data_errors()


@pytest.mark.parametrize(("case", "field", "call"), DATA_ERRORS, ids=[c[0] for c in DATA_ERRORS])
def test_data_errors_are_format_errors_only(case: str, field: str, call: Call) -> None:
    with pytest.raises(HurrayFormatError) as err:
        call()
    assert not isinstance(err.value, HurrayArgumentError), (case, err.value)
    assert err.value.field == field, (case, err.value)
