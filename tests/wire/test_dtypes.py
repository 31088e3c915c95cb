"""Element types and the widening of index buffers."""

from __future__ import annotations

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.wire.dtypes import widen_index
from hurray_vllm.wire.rules import _STRUCTURAL


def _raw(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(v.to_bytes(8, "little") for v in values)), dtype=torch.uint8)


def test_widen_index_keeps_what_an_int64_holds() -> None:
    assert widen_index(_raw([0, 5, 2**63 - 1]), torch.uint64).tolist() == [0, 5, 2**63 - 1]
    u32 = torch.frombuffer(bytearray(b"\xff\xff\xff\xff"), dtype=torch.uint8)
    assert widen_index(u32, torch.uint32).tolist() == [2**32 - 1]


@pytest.mark.parametrize("name", ["block_table.page_id", "seq_ptr.last"])
def test_a_uint64_index_no_int64_holds_names_a_structural_rule(name: str) -> None:
    """Found by a review: the error was named ``block_table`` (waivable by omission) whatever the buffer."""
    with pytest.raises(hv.HurrayFormatError) as err:
        widen_index(_raw([0, 2**64 - 1]), torch.uint64, name)
    assert err.value.field == name and name in _STRUCTURAL
    with pytest.raises(hv.HurrayFormatError) as err:
        widen_index(_raw([2**63]), torch.uint64)
    assert err.value.field in _STRUCTURAL


def test_a_torch_dtype_without_an_element_type_is_the_callers_error_where_the_caller_passed_it() -> None:
    """Found by a review: a writer's caller passing a tensor of such a dtype got a data error (HurrayFormatError)."""
    from hurray_vllm.containers.schema import dense_record, group_head
    from hurray_vllm.wire.dtypes import from_torch

    with pytest.raises(hv.HurrayArgumentError) as err:
        dense_record("x", torch.zeros(2, dtype=torch.bool))
    assert err.value.field == "x" and "bool" in str(err.value)
    with pytest.raises(hv.HurrayArgumentError) as err:
        group_head("g", 1, [2], torch.qint8)
    assert err.value.field == "dtype"
    with pytest.raises(hv.HurrayArgumentError) as err:
        from_torch(torch.bool, argument="dtype")
    assert err.value.field == "dtype"
    # Without ``argument`` it stays a data error: tensors read from a file (a safetensors pool of bools) meet it too.
    with pytest.raises(hv.HurrayFormatError) as err:
        from_torch(torch.bool)
    assert err.value.field == "type_tag" and not isinstance(err.value, hv.HurrayArgumentError)
    assert from_torch(torch.bfloat16, argument="dtype").name == "bfloat16"
