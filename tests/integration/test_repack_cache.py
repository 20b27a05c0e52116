"""The repack cache (`infer.assembly.repack_cache`): a second load maps what the first converted.

A tiny GGUF model is loaded twice: the second load must not convert (calls of
`QuantizedLinear.from_gguf` are counted) and must give bitwise the same buffers and
logits. A corrupt, truncated or stale cache file, or a GGUF file rewritten with other
weights, must give the freshly converted weights, and the cache file is written again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGML_QUANT_SIZES

import infer
from infer.assembly.repack_cache import RepackCache, gguf_layout, max_bytes, prune
from infer.gguf.writer import write_gguf
from infer.quant import QuantizedLinear
from infer.quant.ggml import QType
from infer.testing import build_tokenizer, tiny_hf_model

PROMPT = [3, 17, 5, 9, 2, 11]


def counting_converter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the name of every matrix `QuantizedLinear.from_gguf` converts from now on."""
    calls: list[str] = []
    original = QuantizedLinear.from_gguf.__func__  # type: ignore[attr-defined]

    def counted(cls: type[QuantizedLinear], /, *args: object, **kwargs: object) -> QuantizedLinear:
        calls.append(str(kwargs.get("name", "")))
        result: QuantizedLinear = original(cls, *args, **kwargs)
        return result

    monkeypatch.setattr(QuantizedLinear, "from_gguf", classmethod(counted))
    return calls


def state(llm: infer.LLM) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model (copies)."""
    return {k: v.detach().clone() for k, v in llm.model.state_dict().items()}


@torch.inference_mode()
def logits(llm: infer.LLM) -> torch.Tensor:
    """A prefill's logits and a decode step's (the packed kernel's path)."""
    cache = llm.model.make_cache(1, 16)
    prefill = llm.model(torch.tensor([PROMPT]), cache)
    step = llm.model(prefill[:, -1:].argmax(-1), cache)
    return torch.cat([prefill, step], dim=1)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name


def mapped_from(tensor: torch.Tensor, file: Path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of ``file`` (Linux's /proc/self/maps)."""
    ptr = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(file):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


def cache_files(root: Path) -> list[Path]:
    return sorted((root / "infer" / "repack").glob("*.safetensors"))


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, int], Path]:
    """``make(qtype, seed)``: a tiny Gemma 3 GGUF (tied head) at one fixed path; a private cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok = build_tokenizer(tmp_path / "tok")

    def make(qtype: str, seed: int = 0) -> Path:
        hf = tiny_hf_model("gemma3", seed=seed, query_pre_attn_scalar=32, final_logit_softcapping=None)
        return write_gguf(tmp_path / "model.gguf", hf, tok, qtype=qtype)

    return make


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_1", "Q4_1", "MXFP4"])
def test_second_load_maps_the_cache(
    qtype: str, tiny_gguf: Callable[[str, int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf(qtype, 0)
    reference = infer.load(path, cache=False)
    assert cache_files(tmp_path / "cache") == []  # cache=False writes nothing
    calls = counting_converter(monkeypatch)
    first = infer.load(path)
    converted = len(calls)
    assert converted > 0
    [file] = cache_files(tmp_path / "cache")
    second = infer.load(path)
    assert len(calls) == converted, f"the second load converted {calls[converted:]}"
    assert_same(state(reference), state(first))
    assert_same(state(first), state(second))
    assert torch.equal(logits(first), logits(second))
    assert torch.equal(logits(reference), logits(second))
    # The cached buffers are views of the mapped file, not copies.
    head = second.model.lm_head
    assert isinstance(head, QuantizedLinear)
    buffer = head.weight if head.fmt == "dense" else head.packed
    assert mapped_from(buffer, file)


@pytest.mark.parametrize("damage", ["flip a data byte", "truncate", "garbage header", "empty"])
def test_damaged_cache_falls_back_and_is_rewritten(
    damage: str, tiny_gguf: Callable[[str, int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf("Q8_0", 0)
    reference = state(infer.load(path, cache=False))
    infer.load(path)
    [file] = cache_files(tmp_path / "cache")
    good = file.read_bytes()
    if damage == "flip a data byte":
        bad = bytearray(good)
        bad[len(bad) - 100] ^= 0x10
        file.write_bytes(bytes(bad))
    elif damage == "truncate":
        file.write_bytes(good[: len(good) // 2])
    elif damage == "garbage header":
        file.write_bytes(b"\xff" * 64 + good[64:])
    else:
        file.write_bytes(b"")
    calls = counting_converter(monkeypatch)
    assert_same(reference, state(infer.load(path)))
    assert calls, "a damaged cache file was served"
    assert file.read_bytes() == good  # rewritten
    done = len(calls)
    assert_same(reference, state(infer.load(path)))
    assert len(calls) == done  # and served again


def test_changed_gguf_is_not_served_stale(
    tiny_gguf: Callable[[str, int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf("Q4_0", 0)
    old = state(infer.load(path))
    stat = path.stat()
    tiny_gguf("Q4_0", 1)  # other weights, same path, same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    assert path.stat().st_size == stat.st_size
    calls = counting_converter(monkeypatch)
    new = state(infer.load(path))
    assert calls
    assert_same(state(infer.load(path, cache=False)), new)
    assert not torch.equal(old["layers.0.mlp.down_proj.packed"], new["layers.0.mlp.down_proj.packed"])
    assert len(cache_files(tmp_path / "cache")) == 1  # replaced, not added


def test_other_torch_version_is_stale(
    tiny_gguf: Callable[[str, int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf("Q4_0", 0)
    infer.load(path)
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")  # read when the key is made
    calls = counting_converter(monkeypatch)
    infer.load(path)
    assert calls


def test_unwritable_cache_only_costs_speed(
    tiny_gguf: Callable[[str, int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf("Q4_0", 0)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert_same(state(infer.load(path, cache=False)), state(infer.load(path)))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize(
    "qtype", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "MXFP4", "Q6_K", "Q3_K", "Q2_K", "F16"]
)
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_layout_is_what_conversion_builds(qtype: str, exact: bool, compute_dtype: torch.dtype) -> None:
    """`gguf_layout` (what a cache entry must hold) follows `QuantizedLinear.from_gguf`."""
    qt = QType.__members__[qtype]
    block, size = GGML_QUANT_SIZES[qt]
    n, k = 200, 512
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, k // block * size), dtype=torch.uint8, generator=gen)
    lin = QuantizedLinear.from_gguf(raw, qt, (n, k), compute_dtype=compute_dtype, exact_rescoring=exact)
    layout = gguf_layout(qt, n, k, compute_dtype, exact)
    assert (lin.fmt, lin.planes, lin.paired) == (layout.fmt, layout.planes, layout.paired)
    built = {name: (tuple(b.shape), b.dtype) for name, b in lin.named_buffers()}
    assert built == layout.tensors


def test_key_names_the_file_and_conversion(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(os.urandom(1 << 20))
    a = RepackCache(path, data_start=4096, compute_dtype=torch.bfloat16, root=tmp_path)
    b = RepackCache(path, data_start=4096, compute_dtype=torch.float32, root=tmp_path)
    assert a.file != b.file and a.key != b.key
    stat = path.stat()
    with path.open("r+b") as f:  # one byte of tensor data, in a sampled block; same size and mtime
        f.seek(4096)
        byte = f.read(1)[0]
        f.seek(4096)
        f.write(bytes([byte ^ 1]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert RepackCache(path, data_start=4096, compute_dtype=torch.bfloat16, root=tmp_path).key != a.key


def test_entries_of_deleted_files_are_removed(tiny_gguf: Callable[[str, int], Path], tmp_path: Path) -> None:
    path = tiny_gguf("Q4_0", 0)
    infer.load(path)
    [old] = cache_files(tmp_path / "cache")
    moved = path.rename(tmp_path / "moved.gguf")
    infer.load(moved)  # a new entry (named by the new path); the old one's file is gone
    assert old not in cache_files(tmp_path / "cache")
    assert len(cache_files(tmp_path / "cache")) == 1


def test_a_checked_entry_is_not_checked_again(
    tiny_gguf: Callable[[str, int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN / inf checks of packed buffers run when converting, not on a verified cache hit."""
    from infer.assembly import place

    path = tiny_gguf("Q8_0", 0)
    checked: list[str] = []
    original = place.check_finite

    def counted(values: torch.Tensor, what: str) -> None:
        if "packed form" in what:
            checked.append(what)
        original(values, what)

    monkeypatch.setattr(place, "check_finite", counted)
    infer.load(path, validate=False)  # written unchecked
    assert checked == []
    infer.load(path)  # a hit, but never checked: checked now
    assert checked
    done = len(checked)
    infer.load(path)
    assert len(checked) == done


def test_the_directory_is_pruned_oldest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries past the cap go least recently used first; the one just written always stays."""
    files = []
    for i in range(4):
        f = tmp_path / f"m{i}.safetensors"
        f.write_bytes(b"\0" * 1000)
        os.utime(f, ns=(0, i * 10**9))  # m0 is the least recently used
        files.append(f)
    removed = prune(tmp_path, 2500, keep=files[0])
    print("removed:", [f.name for f in removed])
    assert removed == [files[1], files[2]]  # m0 is kept although oldest; m3 fits under the cap
    assert sorted(tmp_path.glob("*.safetensors")) == [files[0], files[3]]
    assert prune(tmp_path, 0, keep=files[3]) == [files[0]]
    monkeypatch.setenv("INFER_REPACK_CACHE_MAX", "1.5G")
    assert max_bytes() == int(1.5 * 2**30)
    monkeypatch.setenv("INFER_REPACK_CACHE_MAX", "lots")
    with pytest.raises(ValueError, match="INFER_REPACK_CACHE_MAX='lots'"):
        max_bytes()


def test_a_load_keeps_the_cache_under_its_cap(
    tiny_gguf: Callable[[str, int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing an entry prunes the least recently used others past ``INFER_REPACK_CACHE_MAX``."""
    import shutil

    a = tiny_gguf("Q4_0", 0)
    b = shutil.copy(a, tmp_path / "b.gguf")
    infer.load(a)
    [entry_a] = cache_files(tmp_path / "cache")
    infer.load(b)  # under the default cap: both kept
    assert len(cache_files(tmp_path / "cache")) == 2
    entry_b = next(f for f in cache_files(tmp_path / "cache") if f != entry_a)
    os.utime(entry_a, ns=(0, 0))  # a long unused
    cap = 2 * entry_b.stat().st_size + entry_a.stat().st_size // 2  # b's and c's entries, not a third
    monkeypatch.setenv("INFER_REPACK_CACHE_MAX", str(cap))
    c = shutil.copy(a, tmp_path / "c.gguf")
    infer.load(c)  # a third entry of the same size: the oldest (a's) goes, b's stays
    left = cache_files(tmp_path / "cache")
    print("left:", [f.name for f in left])
    assert entry_a not in left and entry_b in left and len(left) == 2


def test_fused_projections_of_a_mapped_cache_are_views_not_copies(
    tiny_gguf: Callable[[str, int], Path], tmp_path: Path
) -> None:
    """The cache writes each matrix's packed bytes in the model's module order, so q/k/v and
    gate/up lie side by side in the file: fusing them on a cache hit makes a view of the mapping
    (no copy, no second set of pages), and the fused model's logits equal the first load's."""
    path = tiny_gguf("Q8_0", 0)
    first = infer.load(path)
    want = logits(first)
    second = infer.load(path)
    [file] = cache_files(tmp_path / "cache")
    attn: Any = second.model.layers[0].self_attn  # fused: q/k/v now views of the fused product's bytes
    q, k, v = (getattr(attn, n).packed for n in ("q_proj", "k_proj", "v_proj"))
    assert mapped_from(q, file) and mapped_from(v, file), "the fused q/k/v packed bytes were copied"
    assert k.data_ptr() == q.data_ptr() + q.nbytes and v.data_ptr() == k.data_ptr() + k.nbytes
    assert torch.equal(logits(second), want)


def test_mapped_matrices_share_no_storage(tiny_gguf: Callable[[str, int], Path], tmp_path: Path) -> None:
    """Each matrix of a cache hit has a storage covering its own bytes, fused q/k/v and gate/up
    their group's: a compiled block's weights are the inputs of one nested region, which refuses
    inputs sharing a storage (every GGUF model from the cache failed ``compile=True`` while all
    were views of one storage: the whole mapped file)."""
    path = tiny_gguf("Q8_0", 0)
    infer.load(path)
    second = infer.load(path)
    [file] = cache_files(tmp_path / "cache")
    layer: Any = second.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    groups = [
        [attn.q_proj, attn.k_proj, attn.v_proj],
        [mlp.gate_proj, mlp.up_proj],
        [attn.o_proj],
        [mlp.down_proj],
    ]
    for group in groups:
        for attr in ("packed", "scale_zero"):
            tensors = [m.get_buffer(attr) for m in group]
            # (a fused scale_zero joins along dim 1: a copy, as ever; packed bytes are mapped)
            assert attr == "scale_zero" or mapped_from(tensors[0], file)
            storage = tensors[0].untyped_storage()
            size = file.stat().st_size
            print(f"{attr} of {len(group)} matrices: a storage of {storage.nbytes()} bytes, the file {size}")
            assert storage.nbytes() == sum(t.nbytes for t in tensors)
