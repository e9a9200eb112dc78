"""A GGUF file's metadata and tensor index, read with struct over the memory-mapped file.

gguf-py's GGUFReader makes a numpy view for every element of every metadata array, which for a
49k-token vocabulary and its merges takes seconds at each start; here a string array is one
Python loop and a numeric array one `np.frombuffer`. Tensors stay views of the mapping, in the
layout gguf-py gives them, so `gguf.quants.dequantize` reads them as it reads gguf-py's.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_FLOAT_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGML order: shape[0] is the contiguous (row) dimension
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # rows x (row elements, or row bytes for a quantized type), a view of the file


class GGUFFile:
    """`metadata`: key -> value (strings decoded, arrays as lists); `tensors`: name -> GGUFTensor."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._buf[:4] != MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        self._pos = 4
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(GGUFValueType(self._unpack("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            shape = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, shape, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        self.tensors = {name: self._tensor(name, shape, kind, start + offset) for name, shape, kind, offset in infos}

    def _unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        self._pos += n
        return self._buf[self._pos - n:self._pos].decode("utf-8", errors="replace")

    def _value(self, kind: GGUFValueType):
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._unpack(_SCALARS[kind])
        item, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self._buf, dtype, count, self._pos)
            self._pos += count * dtype.itemsize
            return values.tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor(self, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        rows = tuple(reversed(shape[1:]))
        if kind in _FLOAT_TENSORS:
            dtype = np.dtype(_FLOAT_TENSORS[kind])
            data = np.frombuffer(self._buf, dtype, int(np.prod(shape)), offset).reshape(*rows, shape[0])
        else:
            block, size = GGML_QUANT_SIZES[kind]
            row_bytes = shape[0] // block * size
            data = np.frombuffer(self._buf, np.uint8, int(np.prod(rows)) * row_bytes, offset).reshape(*rows, row_bytes)
        return GGUFTensor(name, shape, kind, data)
