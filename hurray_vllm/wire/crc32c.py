"""CRC-32C (Castagnoli), as the ``.hrry`` index checksum requires.

Only the index is checksummed (kilobytes). The native kernels
(:mod:`hurray_vllm.native`) compute it when they are loaded; otherwise a
table-driven pure-Python loop does, which keeps the core free of compiled
dependencies.
"""

from __future__ import annotations

__all__ = ["crc32c", "crc32c_python"]


def _table() -> list[int]:
    poly = 0x82F63B78
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _table()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``crc``."""
    from .. import native  # late: keep importing this module free of the native build

    fast = native.crc32c(data, crc)  # None without the native kernels
    return fast if fast is not None else crc32c_python(data, crc)


def crc32c_python(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """The pure-Python CRC-32C (the reference the native one is tested against)."""
    c = crc ^ 0xFFFFFFFF
    table = _TABLE
    for b in bytes(data):
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF
