"""Safetensors loading: `load_weights` (whole dict) and `SafetensorsSource` (lazy, per tensor)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer.loader.weights as weights_mod
from infer.loader.weights import INDEX_FILE, SINGLE_FILE, SafetensorsSource, load_weights


def known_tensors() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4) / 7,
        "model.layers.0.self_attn.q_proj.weight": torch.linspace(-1, 1, 16).reshape(4, 4),
        "model.layers.0.input_layernorm.weight": torch.tensor([1.0, 0.5, -0.25, 2.0]),
        "model.norm.weight": torch.tensor([0.1, 0.2, 0.3, 0.4]),
    }


def write_single(path: Path, tensors: dict[str, torch.Tensor], name: str = SINGLE_FILE) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / name))
    return path


def write_sharded(
    path: Path,
    shards: dict[str, dict[str, torch.Tensor]],
    index: dict[str, str] | None = None,
) -> Path:
    """Write ``shards`` (file name -> tensors) and an index (by default the true weight_map)."""
    path.mkdir(parents=True, exist_ok=True)
    true_map: dict[str, str] = {}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file))
        true_map.update(dict.fromkeys(tensors, file))
    weight_map = index if index is not None else true_map
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def two_shards() -> dict[str, dict[str, torch.Tensor]]:
    t = known_tensors()
    names = list(t)
    return {
        "model-00001-of-00002.safetensors": {n: t[n] for n in names[:2]},
        "model-00002-of-00002.safetensors": {n: t[n] for n in names[2:]},
    }


def assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].shape == tensor.shape, name
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


# --------------------------------------------------------------------------- single file


def test_single_file(tmp_path: Path) -> None:
    path = write_single(tmp_path, known_tensors())
    assert_same(load_weights(path), known_tensors())


def test_single_file_str_path_and_file_path(tmp_path: Path) -> None:
    path = write_single(tmp_path, known_tensors())
    assert_same(load_weights(str(path)), known_tensors())
    assert_same(load_weights(path / SINGLE_FILE), known_tensors())
    assert_same(load_weights(str(path / SINGLE_FILE)), known_tensors())


def test_single_file_dtype_conversion_preserves_values(tmp_path: Path) -> None:
    path = write_single(tmp_path, known_tensors())
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        loaded = load_weights(path, dtype=dtype)
        for name, tensor in known_tensors().items():
            assert loaded[name].dtype == dtype
            assert torch.equal(loaded[name], tensor.to(dtype)), name


def test_single_file_torch_device_object(tmp_path: Path) -> None:
    path = write_single(tmp_path, known_tensors())
    for device in ("cpu", torch.device("cpu")):
        loaded = load_weights(path, device=device)
        assert all(t.device == torch.device("cpu") for t in loaded.values())
        assert_same(loaded, known_tensors())


def test_lone_safetensors_file_with_other_name(tmp_path: Path) -> None:
    path = write_single(tmp_path, known_tensors(), name="weights.safetensors")
    assert_same(load_weights(path), known_tensors())


def test_several_files_without_index_is_an_error(tmp_path: Path) -> None:
    for file, tensors in two_shards().items():
        save_file(tensors, str(tmp_path / file))
    with pytest.raises(FileNotFoundError, match=INDEX_FILE):
        load_weights(tmp_path)


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=SINGLE_FILE):
        load_weights(tmp_path)  # an empty directory


def test_not_a_safetensors_file(tmp_path: Path) -> None:
    (tmp_path / SINGLE_FILE).write_bytes(b"definitely not safetensors")
    with pytest.raises(ValueError, match=SINGLE_FILE):
        load_weights(tmp_path)
    with pytest.raises(ValueError, match=SINGLE_FILE):
        SafetensorsSource(tmp_path)


# --------------------------------------------------------------------------- sharded


def test_sharded(tmp_path: Path) -> None:
    path = write_sharded(tmp_path, two_shards())
    assert_same(load_weights(path), known_tensors())
    assert_same(load_weights(str(path)), known_tensors())


def test_sharded_dtype_conversion_preserves_values(tmp_path: Path) -> None:
    path = write_sharded(tmp_path, two_shards())
    loaded = load_weights(path, dtype=torch.bfloat16)
    assert sorted(loaded) == sorted(known_tensors())
    for name, tensor in known_tensors().items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name


def test_index_takes_precedence_over_single_file(tmp_path: Path) -> None:
    path = write_sharded(tmp_path, two_shards())
    save_file({"decoy": torch.zeros(3)}, str(path / SINGLE_FILE))
    assert_same(load_weights(path), known_tensors())
    assert sorted(SafetensorsSource(path).keys()) == sorted(known_tensors())


SHARD_2 = "model-00002-of-00002.safetensors"
# How an index can disagree with its shards: (change to a correct index, the tensor named, what is said)
INDEX_FAULTS: dict[str, tuple[Callable[[dict[str, str]], dict[str, str]], str, str]] = {
    "in the index but in no shard": (
        lambda index: index | {"model.layers.0.mlp.up_proj.weight": SHARD_2},
        r"model\.layers\.0\.mlp\.up_proj\.weight",
        "not in any shard",
    ),
    "in a shard but not in the index": (
        lambda index: {n: f for n, f in index.items() if n != "model.norm.weight"},
        r"model\.norm\.weight",
        "not listed",
    ),
    "in another shard than the index says": (
        lambda index: index | {"model.norm.weight": "model-00001-of-00002.safetensors"},
        r"model\.norm\.weight",
        "",
    ),
}


@pytest.mark.parametrize("fault", list(INDEX_FAULTS))
def test_index_that_disagrees_with_the_shards(tmp_path: Path, fault: str) -> None:
    change, name, says = INDEX_FAULTS[fault]
    shards = two_shards()
    path = write_sharded(tmp_path, shards, change({n: f for f, ts in shards.items() for n in ts}))
    for load in (load_weights, SafetensorsSource):
        with pytest.raises(ValueError, match=name) as info:
            load(path)
        assert says in str(info.value)


def test_missing_shard_names_the_shard(tmp_path: Path) -> None:
    path = write_sharded(tmp_path, two_shards())
    (path / "model-00002-of-00002.safetensors").unlink()
    for load in (load_weights, SafetensorsSource):
        with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
            load(path)


def test_tensor_stored_twice(tmp_path: Path) -> None:
    t = known_tensors()
    shards = {"a.safetensors": t, "b.safetensors": {"model.norm.weight": t["model.norm.weight"]}}
    index = {n: "a.safetensors" for n in t} | {"model.norm.weight": "b.safetensors"}
    path = write_sharded(tmp_path, shards, index)
    for load in (load_weights, SafetensorsSource):
        with pytest.raises(ValueError, match=r"model\.norm\.weight.*twice"):
            load(path)


def test_index_without_weight_map(tmp_path: Path) -> None:
    write_sharded(tmp_path, two_shards())
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        load_weights(tmp_path)


@pytest.mark.parametrize(
    ("shard", "found"),
    [
        ("/etc/passwd", "'/etc/passwd'"),
        ("../model-00002-of-00002.safetensors", "'../model-00002-of-00002.safetensors'"),
        ("sub/model-00002-of-00002.safetensors", "'sub/model-00002-of-00002.safetensors'"),
        ("..", "'..'"),
        ("", "''"),
        ("a\x00b", "'a\\x00b'"),
        (None, "None"),
        (3, "3"),
        (["x"], "['x']"),
    ],
)
def test_index_shard_names_stay_in_the_checkpoint(tmp_path: Path, shard: object, found: str) -> None:
    """A weight_map entry is the plain name of a shard beside the index: no paths out of the directory."""
    t = known_tensors()
    index: dict[str, object] = {n: "model-00001-of-00002.safetensors" for n in t}
    index["model.norm.weight"] = shard
    path = write_sharded(tmp_path, two_shards(), index)  # type: ignore[arg-type]
    for load in (load_weights, SafetensorsSource):
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert str(path / INDEX_FILE) in message and "'model.norm.weight'" in message and found in message


@pytest.mark.parametrize(
    "text",
    [b"\xff\xfe{not utf-8", b'{"weight_map": {"a": "\xe9"}}', b"[" * 100_000 + b"]" * 100_000, b"{", b""],
    ids=["utf16-ish", "latin-1", "nested", "truncated", "empty"],
)
def test_unreadable_index_is_a_value_error(tmp_path: Path, text: bytes) -> None:
    path = write_sharded(tmp_path, two_shards())
    (path / INDEX_FILE).write_bytes(text)
    for load in (load_weights, SafetensorsSource):
        with pytest.raises(ValueError, match="not valid JSON") as info:
            load(path)
        assert str(path / INDEX_FILE) in str(info.value)


# --------------------------------------------------------------------------- dtypes and devices


def mixed() -> dict[str, torch.Tensor]:
    return {
        "a32": torch.linspace(-2, 2, 12).reshape(3, 4),
        "b16": torch.linspace(-1, 1, 8).to(torch.float16),
        "cbf": torch.tensor([0.5, 1.5, -3.0], dtype=torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
    }


def test_mixed_dtypes_preserved_without_dtype(tmp_path: Path) -> None:
    path = write_single(tmp_path, mixed())
    assert_same(load_weights(path), mixed())


def test_mixed_dtypes_converted_with_dtype(tmp_path: Path) -> None:
    path = write_single(tmp_path, mixed())
    loaded = load_weights(path, dtype=torch.float16)
    for name, tensor in mixed().items():
        if tensor.is_floating_point():
            assert loaded[name].dtype == torch.float16, name
            assert torch.equal(loaded[name], tensor.to(torch.float16)), name
        else:  # integer tensors keep their type: casting ids to float would corrupt them
            assert loaded[name].dtype == torch.int64
            assert torch.equal(loaded[name], tensor)


@pytest.mark.parametrize("device", ["cuda:1", torch.device("cuda", 0), "meta"])
def test_device_is_passed_to_safetensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str | torch.device
) -> None:
    """The device reaches ``safetensors.torch.load_file`` for every shard (no GPU needed to check)."""
    path = write_sharded(tmp_path, two_shards())
    seen: list[tuple[str, Any]] = []
    real_load_file: Callable[..., dict[str, torch.Tensor]] = load_file

    def spy(filename: str, device: Any = "cpu") -> dict[str, torch.Tensor]:
        seen.append((Path(filename).name, device))
        return real_load_file(filename, device="cpu")

    monkeypatch.setattr(weights_mod, "load_file", spy)
    load_weights(path, device=device)
    assert sorted(seen) == sorted((f, str(device)) for f in two_shards())


@pytest.mark.gpu
def test_loads_onto_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = write_sharded(tmp_path, two_shards())
    loaded = load_weights(path, device=torch.device("cuda", 0), dtype=torch.bfloat16)
    assert all(t.device == torch.device("cuda", 0) for t in loaded.values())
    for name, tensor in known_tensors().items():
        assert torch.equal(loaded[name].cpu(), tensor.to(torch.bfloat16))


# --------------------------------------------------------------------------- SafetensorsSource


def test_checkpoint_lists_without_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    reads: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def counting_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        reads.append((offset, len(buffers[0])))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr("infer.loader.source.os.preadv", counting_preadv)
    path = write_sharded(tmp_path, two_shards() | {"model-extra.safetensors": {"ids": torch.arange(3)}})
    ckpt = SafetensorsSource(path)
    assert reads == []  # listing reads headers only
    assert sorted(ckpt.keys()) == sorted([*known_tensors(), "ids"])
    info = ckpt.tensors()["model.embed_tokens.weight"]
    assert info.shape == (6, 4)
    assert info.dtype == torch.float32
    assert info.nbytes == 6 * 4 * 4
    assert ckpt.tensors()["ids"].dtype == torch.int64
    assert "model.norm.weight" in ckpt and "nope" not in ckpt

    norm = ckpt.get("model.norm.weight")
    assert [n for _, n in reads] == [4 * 4]  # exactly one tensor read, of its 16 bytes
    assert torch.equal(norm, known_tensors()["model.norm.weight"])
    rows = torch.empty(2, 4)
    ckpt.read_into("model.embed_tokens.weight", rows, (3, 5))
    assert torch.equal(rows, known_tensors()["model.embed_tokens.weight"][3:5])
    ckpt.close()


def test_checkpoint_values_match_load_weights(tmp_path: Path, tiny_ckpt_factory: Any, sharded: bool) -> None:
    path = tiny_ckpt_factory("gemma3", sharded)
    ckpt = SafetensorsSource(path)
    everything = load_weights(path)
    assert ckpt.tensors().keys() == everything.keys()
    for name in ckpt.tensors():
        assert torch.equal(ckpt.get(name), everything[name]), name
    assert len(ckpt.files) == (
        len(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())) if sharded else 1
    )
    ckpt.close()


def test_checkpoint_unknown_tensor(tmp_path: Path) -> None:
    ckpt = SafetensorsSource(write_single(tmp_path, known_tensors()))
    with pytest.raises(KeyError, match=r"lm_head\.weight"):
        ckpt.get("lm_head.weight")


def test_checkpoint_single_file_and_str(tmp_path: Path) -> None:
    path = write_single(tmp_path, mixed())
    for source in (path, str(path), path / SINGLE_FILE):
        ckpt = SafetensorsSource(source)
        assert_same({name: ckpt.get(name) for name in ckpt.tensors()}, mixed())
        ckpt.close()
