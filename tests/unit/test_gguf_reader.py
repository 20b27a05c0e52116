"""`infer.gguf.reader.GGUFFile` against `gguf.GGUFReader`, and on truncated / corrupt files.

The real files (SmolLM2 Q4_1, Gemma 3 270M Q4_K_M) are compared field by field and
tensor by tensor; small files written with `gguf.GGUFWriter` cover every value type;
every prefix of a small file and random byte corruptions must raise ``ValueError``
naming the file, never crash or hang.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from infer.gguf.reader import GGUFFile, StringArray
from infer.realmodels import gemma3_270m_path, smollm2_path


def _reader_value(field: object) -> object:
    """A GGUFReader field as plain Python / numpy, comparable to ours."""
    types = field.types  # type: ignore[attr-defined]
    if types[0] == GGUFValueType.ARRAY:
        if types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]  # type: ignore[attr-defined]
        return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])  # type: ignore[attr-defined]
    return field.contents()  # type: ignore[attr-defined]


def _compare_with_reader(path: Path) -> int:
    ours = GGUFFile(path)
    ref = GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        field = ref.fields[key]
        expected = _reader_value(field)
        got = ours.metadata[key]
        assert ours.value_types[key] == tuple(int(t) for t in field.types), key
        if isinstance(got, StringArray):
            assert got.tolist() == expected, key
        elif isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(expected).astype(got.dtype), err_msg=key)
        elif isinstance(got, float):
            assert got == pytest.approx(float(expected), rel=0, abs=0), key  # type: ignore[arg-type]
        else:
            assert got == expected, key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type, t.name
        assert info.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        assert info.offset == t.data_offset, t.name
        assert info.nbytes == t.n_bytes, t.name
        head = np.asarray(t.data).reshape(-1).view(np.uint8)[:256]
        np.testing.assert_array_equal(ours.raw(t.name)[:256], head)
    assert ours.data_offset == ref.data_offset
    return len(keys)


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_matches_gguf_reader_on_real_files(which: str) -> None:
    path = smollm2_path() if which == "smollm2" else gemma3_270m_path()
    n = _compare_with_reader(path)
    print(f"{path.name}: {n} metadata fields and every tensor entry identical to GGUFReader")


def _write_small(path: Path) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 7)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, 1.5])
    w.add_array("t.arr_bool", [True, False, True])
    w.add_array("t.arr_str", ["a", "", "ü€"])
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", np.ones((3, 64), dtype=np.float16))
    w.add_tensor("c", np.zeros(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    return _write_small(tmp_path / "small.gguf")


def test_every_value_type_matches_gguf_reader(small_file: Path) -> None:
    _compare_with_reader(small_file)
    f = GGUFFile(small_file)
    assert f.metadata["t.u64"] == 2**63 + 7
    assert f.metadata["t.bool"] is True
    assert f.metadata["t.str"] == "héllo ✓"
    assert f.metadata["t.arr_bool"].tolist() == [True, False, True]
    assert f.metadata["t.arr_str"][2] == "ü€"
    assert f.tensors["b.weight"].shape == (3, 64)
    assert f.tensors["b.weight"].ggml_type == GGMLQuantizationType.F16
    np.testing.assert_array_equal(f.raw("a.weight").view(np.float32), np.arange(64, dtype=np.float32))


def test_header_digest_ignores_path_but_sees_metadata(small_file: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(small_file.read_bytes())
    assert GGUFFile(copy).header_digest() == GGUFFile(small_file).header_digest()
    changed = bytearray(small_file.read_bytes())
    pos = changed.find(b"hello".replace(b"e", "é".encode()))
    changed[pos] ^= 0x01  # "héllo" -> "iéllo": still UTF-8, different metadata
    edited = tmp_path / "edited.gguf"
    edited.write_bytes(bytes(changed))
    assert GGUFFile(edited).header_digest() != GGUFFile(small_file).header_digest()


def _expect_value_error(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        GGUFFile(path)
    message = str(info.value)
    assert str(path) in message
    return message


def test_every_truncation_is_a_clear_error(small_file: Path, tmp_path: Path) -> None:
    data = small_file.read_bytes()
    f = GGUFFile(small_file)
    header_end = f.data_offset
    data_end = max(t.offset + t.nbytes for t in f.tensors.values())  # the writer pads after it
    cut = tmp_path / "cut.gguf"
    # Every prefix of the header, then a few inside the tensor data.
    lengths = [*range(0, header_end), header_end + 1, data_end - 1]
    for n in lengths:
        cut.write_bytes(data[:n])
        _expect_value_error(cut)
    print(f"{len(lengths)} truncations of a {len(data)}-byte file: all ValueError")


def test_bad_magic_and_version(small_file: Path, tmp_path: Path) -> None:
    data = bytearray(small_file.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(data[4:]))
    assert "magic" in _expect_value_error(bad)
    for version in (1, 4, 0xFFFFFFFF):
        bad.write_bytes(bytes(data[:4]) + struct.pack("<I", version) + bytes(data[8:]))
        assert f"version {version}" in _expect_value_error(bad)
    bad.write_bytes(bytes(data[:4]) + struct.pack(">I", 3) + bytes(data[8:]))
    assert "big-endian" in _expect_value_error(bad)


def test_absurd_counts_and_lengths(small_file: Path, tmp_path: Path) -> None:
    data = bytearray(small_file.read_bytes())
    bad = tmp_path / "bad.gguf"
    for offset, what in ((8, "tensor count"), (16, "metadata count")):
        bad.write_bytes(bytes(data[:offset]) + struct.pack("<Q", 2**62) + bytes(data[offset + 8 :]))
        assert "cannot fit" in _expect_value_error(bad), what
    # The first key's length (right after the 24-byte header) claims far more than the file.
    bad.write_bytes(bytes(data[:24]) + struct.pack("<Q", 2**40) + bytes(data[32:]))
    assert "past" in _expect_value_error(bad) or "needs bytes" in _expect_value_error(bad)


def _patch_tensor_entry(path: Path, out: Path, name: bytes, field: str, value: int) -> None:
    data = bytearray(path.read_bytes())
    pos = data.find(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    offsets = {"n_dims": pos, "type": pos + 4 + 8 * n_dims, "offset": pos + 8 + 8 * n_dims, "dim0": pos + 4}
    fmt = "<I" if field in ("n_dims", "type") else "<Q"
    struct.pack_into(fmt, data, offsets[field], value)
    out.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("n_dims", 9, "dimensions"),
        ("type", 1234, "unknown ggml type"),
        ("offset", 2**40, "past the end"),
        ("offset", 4, "not a multiple"),
        ("dim0", 0, "empty dimension"),
        ("dim0", 2**40, "past the end"),
    ],
)
def test_bad_tensor_entries(small_file: Path, tmp_path: Path, field: str, value: int, needle: str) -> None:
    bad = tmp_path / "bad.gguf"
    _patch_tensor_entry(small_file, bad, b"a.weight", field, value)
    message = _expect_value_error(bad)
    assert needle in message and "a.weight" in message


@pytest.mark.parametrize(
    ("name", "offset", "needle"),
    [
        (b"b.weight", 0, "tensor 'b.weight' has data offset 0, expected 256 (tensor 'a.weight' ends at 256)"),
        (b"b.weight", 224, "tensor 'b.weight' has data offset 224, expected 256"),  # overlaps a's end
        (b"b.weight", 288, "tensor 'b.weight' has data offset 288, expected 256"),  # shifted: a gap
        (b"c", 256, "tensor 'c' has data offset 256, expected 640 (tensor 'b.weight' ends at 640)"),
        (
            b"a.weight",
            256,
            "tensor 'a.weight' has data offset 256, expected 0 (the first tensor starts at 0)",
        ),
    ],
)
def test_overlapping_or_shifted_tensor_data(
    small_file: Path, tmp_path: Path, name: bytes, offset: int, needle: str
) -> None:
    """Tensor data must follow the table's order, each padded to the alignment (llama.cpp's rule)."""
    f = GGUFFile(small_file)
    assert [(t.name, t.offset - f.data_offset, t.nbytes) for t in f.tensors.values()] == [
        ("a.weight", 0, 256),
        ("b.weight", 256, 384),
        ("c", 640, 20),
    ]
    bad = tmp_path / "bad.gguf"
    _patch_tensor_entry(small_file, bad, name, "offset", offset)
    message = _expect_value_error(bad)
    print(message)
    assert needle in message


def test_duplicate_metadata_key(small_file: Path, tmp_path: Path) -> None:
    data = small_file.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data.replace(b"t.i16", b"t.u16", 1))  # two keys named "t.u16"
    assert "metadata key 't.u16' appears twice" in _expect_value_error(bad)


def test_random_corruption_never_crashes(small_file: Path, tmp_path: Path) -> None:
    data = small_file.read_bytes()
    header_end = GGUFFile(small_file).data_offset
    rng = random.Random(0)
    bad = tmp_path / "fuzz.gguf"
    outcomes = {"parsed": 0, "ValueError": 0}
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(header_end)] = rng.randrange(256)
        bad.write_bytes(bytes(mutated))
        try:
            GGUFFile(bad)
            outcomes["parsed"] += 1
        except ValueError as e:
            assert str(bad) in str(e)
            outcomes["ValueError"] += 1
    print(f"300 random header corruptions: {outcomes}")
    # Measured 273 refused, 27 parsed (changes inside strings that stay valid UTF-8). A reader
    # that refused nothing, or everything, would fail here.
    assert outcomes["ValueError"] >= 250 and outcomes["parsed"] >= 10


def test_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "missing.gguf")
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GGUF")
    assert "24-byte header" in _expect_value_error(tiny)
