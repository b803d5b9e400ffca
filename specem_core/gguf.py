"""Check a GGUF file before any backend loads it: pure Python, header only.

:func:`validate_gguf` reads the header (magic, version, metadata, tensor infos) and checks that
the file is long enough to hold every tensor it declares, so that a missing, foreign, truncated or
half-downloaded file is reported in one line naming the file, instead of a crash deep inside
llama.cpp or transformers. Tensor data is never read: the file is memory-mapped and only the
header's pages are touched, so checking a multi-GB file takes milliseconds.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3; both
byte orders).

Example:
    >>> info = validate_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")        # doctest: +SKIP
    >>> info.architecture, info.context_length, info.has_chat_template  # doctest: +SKIP
    ('llama', 8192, True)
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specem_core.errors import ModelNotFoundError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_KEEP_ARRAY_VALUES = 256
"""Arrays up to this length keep their values in :attr:`GGUFInfo.metadata`; longer ones (the
tokenizer's vocabulary and merges) keep only their item type and length."""

# metadata value types (gguf_type)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALARS: dict[int, tuple[str, str]] = {  # type -> (struct code, name)
    _UINT8: ("B", "uint8"),
    _INT8: ("b", "int8"),
    _UINT16: ("H", "uint16"),
    _INT16: ("h", "int16"),
    _UINT32: ("I", "uint32"),
    _INT32: ("i", "int32"),
    _FLOAT32: ("f", "float32"),
    _BOOL: ("?", "bool"),
    _UINT64: ("Q", "uint64"),
    _INT64: ("q", "int64"),
    _FLOAT64: ("d", "float64"),
}
_TYPE_NAMES = {**{t: name for t, (_, name) in _SCALARS.items()}, _STRING: "string", _ARRAY: "array"}

GGML_TYPES: dict[int, tuple[str, int, int]] = {
    # ggml_type -> (name, elements per block, bytes per block), as ggml's type traits
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),  # two fp16 + 32 int8 (gguf-py's table says 40; ggml's sizeof is 36)
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
"""Known tensor types. A tensor of another type is only checked to start inside the file."""


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: its item type and length (values only for short arrays)."""

    item_type: str
    length: int
    values: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's header entry."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    """Offset of the tensor's data from :attr:`GGUFInfo.data_offset`."""
    nbytes: int | None
    """Size of the data; ``None`` for a type missing from :data:`GGML_TYPES`."""

    @property
    def type_name(self) -> str:
        """``Q4_1``, ``F32``… (``type_<n>`` for an unknown type)."""
        known = GGML_TYPES.get(self.ggml_type)
        return known[0] if known else f"type_{self.ggml_type}"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFInfo:
    """What :func:`validate_gguf` read from a complete GGUF file."""

    path: Path
    version: int
    file_size: int
    alignment: int
    data_offset: int
    """Where tensor data starts (the header, padded to :attr:`alignment`)."""
    data_end: int
    """End of the last tensor's data (at most :attr:`file_size`)."""
    metadata: dict[str, Any] = field(repr=False)
    """Every key: scalars and strings as values, arrays as :class:`GGUFArray`."""
    tensors: tuple[GGUFTensor, ...] = field(repr=False)
    byte_order: str = "little"

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    @property
    def architecture(self) -> str | None:
        """``general.architecture``: ``llama``, ``qwen2``, ``gemma3``…"""
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    @property
    def name(self) -> str | None:
        """``general.name``."""
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None

    @property
    def context_length(self) -> int | None:
        """``<architecture>.context_length``: the context the model was trained for."""
        value = self.metadata.get(f"{self.architecture}.context_length")
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def chat_template(self) -> str | None:
        """``tokenizer.chat_template`` (Jinja), if the file has one."""
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def bos_token_id(self) -> int | None:
        return self._int("tokenizer.ggml.bos_token_id")

    @property
    def eos_token_id(self) -> int | None:
        return self._int("tokenizer.ggml.eos_token_id")

    def _int(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class _Truncated(Exception):
    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class _Reader:
    """Sequential little- or big-endian reads from a buffer (a memory map: only touched pages are read)."""

    def __init__(self, buf: Any, size: int, order: str) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0
        self.order = order
        self._structs = {code: struct.Struct(order + code) for code, _ in _SCALARS.values()}

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise _Truncated(self.pos + n)

    def scalar(self, code: str) -> Any:
        fmt = self._structs[code]
        if self.pos + fmt.size > self.size:
            raise _Truncated(self.pos + fmt.size)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def u32(self) -> int:
        return int(self.scalar("I"))

    def u64(self) -> int:
        return int(self.scalar("Q"))

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        u64, buf, size, pos = self._structs["Q"], self.buf, self.size, self.pos
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated(pos + 8)
            pos += 8 + u64.unpack_from(buf, pos)[0]
            if pos > size:
                raise _Truncated(pos)
        self.pos = pos


def validate_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read a GGUF file's header and check that the file holds all the data it declares.

    Only the header is read (magic, version, metadata, tensor infos); tensor data is not.

    Raises:
        ModelNotFoundError: naming the file, when it is missing, a directory, unreadable, not a
            GGUF file, of an unsupported version, malformed, or truncated ("… is truncated:
            expected at least N bytes, found M").
    """
    p = Path(path)
    if p.is_dir():
        raise ModelNotFoundError(f"{p} is a directory, not a GGUF file")
    try:
        handle = p.open("rb")
    except FileNotFoundError:
        raise ModelNotFoundError(f"GGUF file not found: {p}") from None
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read GGUF file {p}: {exc.strerror or exc}") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        if head[:4] != MAGIC[: len(head[:4])] or (size >= 4 and head[:4] != MAGIC):
            raise ModelNotFoundError(f"{p} is not a GGUF file (it starts with {head[:4]!r}, not {MAGIC!r})")
        if size < 8:
            raise ModelNotFoundError(_truncated(p, 8, size))
        version_le, version_be = struct.unpack("<I", head[4:8])[0], struct.unpack(">I", head[4:8])[0]
        if version_le in SUPPORTED_VERSIONS or version_be not in SUPPORTED_VERSIONS:
            order, version = "<", version_le
        else:
            order, version = ">", version_be
        if version not in SUPPORTED_VERSIONS:
            supported = " and ".join(str(v) for v in SUPPORTED_VERSIONS)
            raise ModelNotFoundError(f"{p}: unsupported GGUF version {version} (supported: {supported})")
        try:
            buf: Any = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"cannot read GGUF file {p}: {exc}") from None
        try:
            reader = _Reader(buf, size, order)
            reader.pos = 8
            try:
                return _parse(p, reader, version)
            except _Truncated as exc:
                raise ModelNotFoundError(_truncated(p, exc.needed, size)) from None
        finally:
            buf.close()


def read_token_texts(path: str | os.PathLike[str], ids: Iterable[int]) -> dict[int, str]:
    """The texts of the tokens ``ids`` in a GGUF file's vocabulary (``tokenizer.ggml.tokens``):
    the special tokens a chat template writes (BOS, end of turn) without loading a tokenizer.
    Ids outside the vocabulary are left out.

    Raises:
        ModelNotFoundError: as :func:`validate_gguf`.
    """
    wanted = {int(i) for i in ids}
    info = validate_gguf(path)  # a file that passes this one parses below
    with Path(path).open("rb") as handle:
        buf: Any = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            r = _Reader(buf, info.file_size, "<" if info.byte_order == "little" else ">")
            r.pos = 8
            r.u64()  # tensors
            for _ in range(r.u64()):
                key = r.string()
                value_type = r.u32()
                if key != "tokenizer.ggml.tokens" or value_type != _ARRAY:
                    _value(info.path, r, value_type, key)
                    continue
                if r.u32() != _STRING:
                    return {}
                out: dict[int, str] = {}
                for i in range(r.u64()):
                    if i in wanted:
                        out[i] = r.string()
                        if len(out) == len(wanted):
                            break
                    else:
                        r.skip_strings(1)
                return out
            return {}
        finally:
            buf.close()


def _truncated(path: Path, needed: int, found: int) -> str:
    return f"{path} is truncated: expected at least {needed} bytes, found {found}"


def _parse(path: Path, r: _Reader, version: int) -> GGUFInfo:
    n_tensors = r.u64()
    n_kv = r.u64()
    # every key-value pair and tensor info takes at least 12 / 24 bytes: a huge count is a cut or
    # corrupt header, not a reason to loop for ever
    if n_kv * 12 + n_tensors * 24 > r.size:
        raise _Truncated(r.pos + n_kv * 12 + n_tensors * 24)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        value_type = r.u32()
        metadata[key] = _value(path, r, value_type, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelNotFoundError(f"{path} is not a valid GGUF file: general.alignment is {alignment!r}")
    tensors: list[GGUFTensor] = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.u32()
        if n_dims > _MAX_DIMS:
            raise ModelNotFoundError(f"{path} is not a valid GGUF file: tensor {name!r} has {n_dims} dimensions")
        dims = tuple(r.u64() for _ in range(n_dims))
        ggml_type = r.u32()
        offset = r.u64()
        if offset % alignment:
            raise ModelNotFoundError(
                f"{path} is not a valid GGUF file: tensor {name!r} starts at offset {offset}, "
                f"not a multiple of the alignment {alignment}"
            )
        tensors.append(GGUFTensor(name, dims, ggml_type, offset, _nbytes(dims, ggml_type)))
    data_offset = -(-r.pos // alignment) * alignment
    data_end = r.pos  # a file without tensors (a vocabulary) need not be padded
    for t in tensors:
        data_end = max(data_end, data_offset + t.offset + (t.nbytes or 0))
    if data_end > r.size:
        raise _Truncated(data_end)
    return GGUFInfo(
        path=path,
        version=version,
        file_size=r.size,
        alignment=alignment,
        data_offset=data_offset,
        data_end=data_end,
        metadata=metadata,
        tensors=tuple(tensors),
        byte_order="little" if r.order == "<" else "big",
    )


def _value(path: Path, r: _Reader, value_type: int, key: str) -> Any:
    if value_type in _SCALARS:
        return r.scalar(_SCALARS[value_type][0])
    if value_type == _STRING:
        return r.string()
    if value_type != _ARRAY:
        raise ModelNotFoundError(f"{path} is not a valid GGUF file: key {key!r} has unknown value type {value_type}")
    item_type = r.u32()
    length = r.u64()
    if item_type in _SCALARS:
        code = _SCALARS[item_type][0]
        width = struct.calcsize(code)
        r.need(length * width)
        values = None
        if length <= _KEEP_ARRAY_VALUES:
            values = struct.unpack_from(f"{r.order}{length}{code}", r.buf, r.pos)
        r.pos += length * width
        return GGUFArray(_TYPE_NAMES[item_type], length, values)
    if item_type == _STRING:
        r.need(length * 8)  # each string has at least its 8-byte length
        if length <= _KEEP_ARRAY_VALUES:
            return GGUFArray("string", length, tuple(r.string() for _ in range(length)))
        r.skip_strings(length)
        return GGUFArray("string", length)
    if item_type == _ARRAY:  # arrays of arrays: allowed by the format, unused in practice
        return GGUFArray("array", length, tuple(_value(path, r, _ARRAY, key) for _ in range(length)))
    raise ModelNotFoundError(f"{path} is not a valid GGUF file: key {key!r} is an array of unknown type {item_type}")


def _nbytes(dims: tuple[int, ...], ggml_type: int) -> int | None:
    known = GGML_TYPES.get(ggml_type)
    if known is None:
        return None
    _, block, type_size = known
    n = 1
    for d in dims:
        n *= d
    return -(-n // block) * type_size
