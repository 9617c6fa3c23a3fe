"""A small GGUF reader: metadata as plain Python values, tensors as dequantized numpy arrays.

`gguf.GGUFReader` builds a numpy view per string (~1.6 s for a 49k vocabulary plus merges), so we
walk the file ourselves with `struct` over an mmap and use the `gguf` package only to dequantize.
Layout (little-endian, GGUF v2/v3):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv      × (string key, u32 value type, value)       string = u64 length + UTF-8 bytes
    n_tensors × (string name, u32 n_dims, n_dims × u64 dims (fastest first), u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then tensor data (offsets are relative to here)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value type → numpy dtype, for scalars and numeric arrays alike
_DTYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that is not GGUF, or is corrupt or truncated."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): [out, in] for a weight matrix
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """Parse once; `metadata` and `tensors` are ready after construction (weights stay on disk)."""

    def __init__(self, path: str | Path, read_tensors: bool = True):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            header = f.read(24)
            if len(header) < 24 or header[:4] != b"GGUF":
                raise GGUFError(f"{self.path}: not a GGUF file (bad magic bytes)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", header, 4)
            if version not in (2, 3):
                raise GGUFError(f"{self.path}: GGUF version {version} is not supported (expected 2 or 3)")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            offset = self._read_metadata(n_kv)
            self.tensors: dict[str, TensorInfo] = self._read_tensor_infos(n_tensors, offset) if read_tensors else {}
        except (struct.error, UnicodeDecodeError, KeyError, ValueError, OverflowError) as exc:
            self._buf.close()
            raise GGUFError(f"{self.path}: corrupt or truncated GGUF file ({exc!r})") from exc

    def _read_metadata(self, n_kv: int) -> int:
        offset, self.metadata = 24, {}
        for _ in range(n_kv):
            key, offset = _read_string(self._buf, offset)
            (value_type,) = struct.unpack_from("<I", self._buf, offset)
            self.metadata[key], offset = _read_value(self._buf, offset + 4, value_type)
        return offset

    def _read_tensor_infos(self, n_tensors: int, offset: int) -> dict[str, TensorInfo]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        raw = []
        for _ in range(n_tensors):
            name, offset = _read_string(self._buf, offset)
            (n_dims,) = struct.unpack_from("<I", self._buf, offset)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, offset + 4)
            ggml_type, rel = struct.unpack_from("<IQ", self._buf, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            raw.append((name, tuple(reversed(dims)), ggml_type, rel))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-offset // align) * align
        infos = {}
        for name, shape, ggml_type, rel in raw:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name} has unknown ggml type {ggml_type}") from None
            nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
            start = data_start + rel
            if start + nbytes > len(self._buf):
                raise ValueError(f"tensor {name} ({nbytes} bytes at {start}) runs past the end of the file")
            infos[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
        return infos

    def raw(self, name: str) -> np.ndarray:
        """The named tensor's bytes as stored (a read-only view of the mapped file), [rows, row bytes]."""
        info = self.tensors[name]
        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(rows, -1)

    def dequantize(self, name: str) -> np.ndarray:
        """The named tensor as a writable float32 array of its logical shape."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            if qtype == GGMLQuantizationType.BF16:
                data = data.view(np.uint16).astype(np.uint32) << 16
                return data.view(np.float32).reshape(info.shape).copy()
            return data.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16).reshape(info.shape).astype(np.float32)
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = data.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)
        return np.array(dequantize(rows, qtype), dtype=np.float32)

    def close(self) -> None:
        self._buf.close()


def read_gguf_metadata(path: str | Path, prefix: str = "") -> dict[str, Any]:
    """Key/value metadata of a GGUF file as plain Python values (only keys starting with `prefix`)."""
    f = GGUFFile(path, read_tensors=False)
    f.close()
    return {k: v for k, v in f.metadata.items() if k.startswith(prefix)}


def _read_string(buf: mmap.mmap, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offset)
    end = offset + 8 + n
    if end > len(buf):
        raise struct.error(f"string of {n} bytes runs past the end of the file")
    return buf[offset + 8 : end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, offset: int, value_type: int) -> tuple[Any, int]:
    if value_type == _STRING:
        return _read_string(buf, offset)
    if value_type != _ARRAY:
        dtype = np.dtype(_DTYPES[value_type])
        return np.frombuffer(buf, dtype=dtype, count=1, offset=offset)[0].item(), offset + dtype.itemsize
    item_type, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    if item_type in _DTYPES:
        dtype = np.dtype(_DTYPES[item_type])
        if offset + count * dtype.itemsize > len(buf):
            raise struct.error(f"array of {count} items runs past the end of the file")
        items = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).tolist()  # view dropped at once
        return items, offset + count * dtype.itemsize
    items = []
    for _ in range(count):
        item, offset = _read_value(buf, offset, item_type)
        items.append(item)
    return items, offset
