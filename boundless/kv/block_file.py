"""The file format of the disk KV store: a fixed header, then one or more blocks' KV as raw bytes.

A file is ``HEADER_SIZE`` bytes of header, then the payload: the KV of ``n`` blocks laid out as
[n, layers, 2, kv_heads, block_size, head_dim] in the layout's dtype (the store writes ``n = 1``; the
benchmark measures chunks of several blocks with the same format). The header (little-endian) holds

    magic "BKVS", format version, header size, key (16 bytes: the chained block hash of the file's last
    block), layout digest (16 bytes), dtype name, shape (n, layers, 2, kv_heads, block_size, head_dim),
    payload bytes, crc32 of the payload, crc32 of the header fields before it.

A reader states what it expects (:class:`BlockFileSpec` and the key) and every field is checked: a file
of another model, dtype or layout, a truncated file or a flipped bit raises :class:`BlockFileError`.
Files are written to a temporary name and renamed into place, so a reader never sees a half-written file
under a block's name (a process killed mid-write leaves only its temporary file).
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"BKVS"
FORMAT_VERSION = 1
# The fields, then zeros up to HEADER_SIZE: the payload starts aligned for any dtype (and for O_DIRECT-sized
# reads, should they come).
_FIELDS = struct.Struct("<4sHH16s16s16s6IQI")
_HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = 128
assert _FIELDS.size + _HEADER_CRC.size <= HEADER_SIZE


class BlockFileError(ValueError):
    """A file that must not be served: truncated, corrupted, or written for another layout or key."""


@dataclass(frozen=True)
class BlockFileSpec:
    """What a reader expects of a file besides its key: the layout digest, dtype and payload shape."""

    layout_digest: bytes  # 16 bytes
    dtype: torch.dtype
    shape: tuple[int, ...]  # (n, layers, 2, kv_heads, block_size, head_dim)

    @property
    def payload_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def file_bytes(self) -> int:
        return HEADER_SIZE + self.payload_bytes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_header(key: bytes, spec: BlockFileSpec, payload: memoryview) -> bytes:
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        key,
        spec.layout_digest,
        dtype_name(spec.dtype).encode(),
        *spec.shape,
        len(payload),
        zlib.crc32(payload),
    )
    header = fields + _HEADER_CRC.pack(zlib.crc32(fields))
    return header + bytes(HEADER_SIZE - len(header))


def payload_view(blocks: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(blocks.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """Write every byte of ``parts`` (``writev`` may stop short, e.g. on a filling disk)."""
    parts = [p for p in parts if len(p)]
    while parts:
        n = os.writev(fd, parts)
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts:
            parts[0] = parts[0][n:]


def write_block_file(
    path: Path,
    tmp_path: Path,
    key: bytes,
    spec: BlockFileSpec,
    payload: memoryview,
    *,
    mtime_ns: int,
    durable: bool,
    mid_write: Callable[[Path], None] | None = None,
) -> None:
    """Write ``payload`` under ``path`` atomically: into ``tmp_path`` (same directory), then renamed.

    ``mtime_ns`` stamps the file (the store's LRU clock). ``durable`` fsyncs before the rename; without it a
    crash of the machine may leave a file whose checksum fails (detected on read), never a wrong block.
    ``mid_write`` (tests) is called halfway through the payload. Raises ``OSError``; removes the temporary
    file on failure.
    """
    header = encode_header(key, spec, payload)
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            if mid_write is None:
                _write_all(fd, [memoryview(header), payload])
            else:
                half = len(payload) // 2
                _write_all(fd, [memoryview(header), payload[:half]])
                mid_write(tmp_path)
                _write_all(fd, [payload[half:]])
            os.utime(fd, ns=(mtime_ns, mtime_ns))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)
        raise


def read_block_file(fd: int, file_bytes: int, key: bytes, spec: BlockFileSpec) -> torch.Tensor:
    """The payload of the open file ``fd`` (of ``file_bytes`` bytes) shaped ``spec.shape``, every field checked.

    Raises :class:`BlockFileError` for a file that must not be served, ``OSError`` for I/O trouble.
    """
    if file_bytes != spec.file_bytes:
        raise BlockFileError(f"{file_bytes} bytes where {spec.file_bytes} are expected (truncated or another layout)")
    buf = torch.empty(file_bytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    pos = 0
    while pos < file_bytes:
        got = os.preadv(fd, [view[pos:]], pos)
        if got == 0:
            raise BlockFileError(f"file shrank to {pos} bytes while read")
        pos += got
    _check_header(view, key, spec)
    return buf[HEADER_SIZE:].view(spec.dtype).view(spec.shape)


def read_block_file_into(fd: int, file_bytes: int, key: bytes, spec: BlockFileSpec, payload: memoryview) -> None:
    """Read the open file ``fd`` (of ``file_bytes`` bytes) with its payload straight into ``payload`` (a buffer
    of exactly ``spec.payload_bytes`` that the caller reuses), every field checked as :func:`read_block_file`
    does. On :class:`BlockFileError` or ``OSError`` the buffer's contents are undefined."""
    if file_bytes != spec.file_bytes:
        raise BlockFileError(f"{file_bytes} bytes where {spec.file_bytes} are expected (truncated or another layout)")
    header = memoryview(bytearray(HEADER_SIZE))
    parts, pos = [header, payload], 0
    while parts:
        got = os.preadv(fd, parts, pos)
        if got == 0:
            raise BlockFileError(f"file shrank to {pos} bytes while read")
        pos += got
        while parts and got >= len(parts[0]):
            got -= len(parts[0])
            parts.pop(0)
        if parts:
            parts[0] = parts[0][got:]
    _check_header(header, key, spec, payload)


def _check_header(view: memoryview, key: bytes, spec: BlockFileSpec, payload: memoryview | None = None) -> None:
    """Check a file's header (``view`` holds the whole file, or the header with ``payload`` apart)."""
    fields = view[: _FIELDS.size]
    (header_crc,) = _HEADER_CRC.unpack_from(view, _FIELDS.size)
    if zlib.crc32(fields) != header_crc:
        raise BlockFileError("header checksum mismatch")
    magic, version, header_size, file_key, digest, dtype, *rest = _FIELDS.unpack(fields)
    shape, payload_bytes, payload_crc = tuple(rest[:6]), rest[6], rest[7]
    if magic != MAGIC or version != FORMAT_VERSION or header_size != HEADER_SIZE:
        raise BlockFileError(f"not a version-{FORMAT_VERSION} block file (magic {magic!r}, version {version})")
    if digest != spec.layout_digest:
        raise BlockFileError("written for another layout (model, dtype or KV shape)")
    if dtype.rstrip(b"\0").decode(errors="replace") != dtype_name(spec.dtype) or shape != spec.shape:
        raise BlockFileError(f"shape {shape} / dtype {dtype!r} differ from the layout's")
    if file_key != key:
        raise BlockFileError("holds another block's key")
    if payload_bytes != spec.payload_bytes:
        raise BlockFileError("payload size differs from the header's")
    if zlib.crc32(view[HEADER_SIZE:] if payload is None else payload) != payload_crc:
        raise BlockFileError("payload checksum mismatch")
