"""`infer.aot.tiles`: dequantized tiles as ahead-of-time packages.

Without a package a tile stays eager and its spec is queued for the builder (never under
``INFER_AOT=off``, never from a test process unless ``INFER_AOT=on``); a damaged package is
removed; a package of another CPU, thread count or shape is never picked. The slow tests build
packages (AOTInductor, ~25 s each) and check them bitwise against the eager tiles and products,
once through the background builder as a user's process gets them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from infer import aot
from infer.aot import builder, settings
from infer.aot import tiles as tile_packages
from infer.quant import QuantizedLinear, int4, routes, tiles
from infer.testing import random_gguf

K = 512


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package cache of this test's own, packages on (the suite turns them off), a fresh
    table of loaded packages, and tiles of small matrices eligible."""
    monkeypatch.setattr(settings, "CACHE_DIR", tmp_path / "aot")
    monkeypatch.setattr(builder, "RUN_LOCK", tmp_path / "run.lock")
    monkeypatch.setattr(tile_packages, "PACKAGES", tile_packages.Packages())
    monkeypatch.setattr(tiles, "MIN_WEIGHTS", 0)
    monkeypatch.setenv("INFER_AOT", "use")
    monkeypatch.delenv("INFER_DEQUANT", raising=False)  # the default: packaged
    return tmp_path / "aot"


def _module(qtype: T, n: int = 256, split: bool = False) -> QuantizedLinear:
    raw = random_gguf(qtype, n, K, seed=int(qtype))
    return QuantizedLinear.from_gguf(raw, qtype, (n, K), exact_rescoring=split, compute_dtype=torch.bfloat16)


def _call(lin: QuantizedLinear, rows: int = 2 * int4.BLOCK_N) -> tuple[tiles.Kernel, tuple[object, ...]]:
    call = lin._tile_call(0, rows, torch.bfloat16)
    assert call is not None
    return call


def test_the_spec_names_shapes_dtypes_threads_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fn, args = _call(_module(T.Q4_0))
    packed = args[0]
    assert isinstance(packed, torch.Tensor)
    spec = tile_packages.spec_of(fn, args)
    assert spec is not None and spec.fn == "one_plane" and spec.threads == torch.get_num_threads()
    print(f"\n{spec.key}: {spec.args}")
    assert tile_packages.Spec.of_request(json.loads(json.dumps(spec.request()))) == spec  # as queued
    other_shape = tile_packages.spec_of(fn, (packed[:32], *args[1:]))
    assert other_shape is not None and other_shape.key != spec.key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # inductor writes the thread count into the code
        more = tile_packages.spec_of(fn, args)
        assert more is not None and more.key != spec.key
    finally:
        torch.set_num_threads(threads)
    here = spec.key
    name, flags, platform = routes.cpu_identity()
    monkeypatch.setattr(routes, "cpu_identity", lambda: (name, flags.replace("avx2", "").strip(), platform))
    tile_packages._key.cache_clear()
    try:  # another CPU's package is another file: never loaded here
        assert tile_packages.Spec(spec.fn, spec.args, spec.threads).key != here
    finally:
        tile_packages._key.cache_clear()
    strided = packed.t().contiguous().t()
    assert tile_packages.spec_of(fn, (strided, *args[1:])) is None  # compiled code reads one layout


def test_a_missing_package_runs_eagerly_and_is_queued_once(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Path] = []
    monkeypatch.setattr(builder, "start", lambda directory: started.append(directory))
    lin = _module(T.Q4_K)
    fn, args = _call(lin)
    monkeypatch.setenv("INFER_AOT", "on")  # (a test process queues only when told to)
    assert tiles.run(fn, *args) is None
    assert tiles.run(fn, *args) is None
    queued = [json.loads(p.read_text()) for p in builder.queue_dir(cache).glob("*.json")]
    print(f"\nqueued: {queued}")
    assert len(queued) == 1 and started == [cache]
    request = queued[0]
    assert (
        request["out"] == str(cache / "tiles" / f"{request['key']}.pt2")
        and request["tile"]["fn"] == fn.__name__
    )
    assert builder.stale(request) is None  # no checkpoint to check: the builder takes it
    assert builder.enough_memory(None) in (True, False)


@pytest.mark.parametrize("setting", ["use", "off"])
def test_nothing_is_queued_unless_builds_are_on(
    cache: Path, setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFER_AOT", setting)
    fn, args = _call(_module(T.Q4_0))
    assert tiles.run(fn, *args) is None
    assert not builder.queue_dir(cache).exists() or not list(builder.queue_dir(cache).glob("*.json"))
    monkeypatch.delenv("INFER_AOT")  # unset: builds in a user's process, not in pytest's
    tile_packages.PACKAGES.looked.clear()  # (looked at just now: it would not look again yet)
    assert tiles.run(fn, *args) is None
    assert not tile_packages.PACKAGES.queued


def test_a_damaged_package_is_removed_and_its_tiles_stay_eager(cache: Path) -> None:
    lin = _module(T.Q4_0)
    fn, args = _call(lin)
    spec = tile_packages.spec_of(fn, args)
    assert spec is not None
    path = cache / "tiles" / f"{spec.key}.pt2"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a package")
    with pytest.warns(UserWarning, match="cannot load the tile package"):
        assert tiles.run(fn, *args) is None
    assert not path.exists()
    time.sleep(tile_packages.RECHECK_S)
    assert tiles.run(fn, *args) is None  # not looked for again in this process
    x = torch.randn(64, K).bfloat16()
    with torch.inference_mode():
        assert torch.equal(lin._product(x, False, 0), lin._product(x, False, 0))


def test_the_mode_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_DEQUANT", "fast")
    with pytest.raises(ValueError, match="INFER_DEQUANT must be one of packaged, compiled, eager"):
        tiles.mode()


# ---- built packages (slow) ---------------------------------------------------------------------


def _built(lin: QuantizedLinear, cache: Path) -> None:
    """Build the packages of ``lin``'s tile shapes in this process (as the worker does)."""
    for a, b in lin._tile_spans():
        if (b - a) % int4.BLOCK_N == 0:
            fn, args = _call(lin, b - a)
            spec = tile_packages.spec_of(fn, args)
            assert spec is not None
            path = cache / "tiles" / f"{spec.key}.pt2"
            if not path.exists():
                t0 = time.perf_counter()
                tile_packages.build(spec, path)
                print(f"\nbuilt {spec.fn} {spec.args[0]} in {time.perf_counter() - t0:.1f} s, "
                      f"{path.stat().st_size / 2**20:.1f} MiB")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("qtype", "split"), [(T.Q4_K, False), (T.Q5_0, False), (T.Q8_0, True), (T.Q6_K, False)],
    ids=["one plane", "two planes side by side", "two planes split", "paired"],
)  # fmt: skip
def test_packaged_tiles_and_products_equal_eager(
    qtype: T, split: bool, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each form's packaged tile is the eager tile bitwise, and a many-row product through the
    packages (the tail block eager) is the eager product bitwise."""
    lin = _module(qtype, n=300, split=split)  # whole blocks and a tail block
    assert lin.fmt == "int4" and lin.split == split
    _built(lin, cache)
    x = torch.randn(200, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode():
        fn, args = _call(lin, 256)
        packaged = tiles.run(fn, *args)
        product = lin._product(x, False, 0)
        assert lin._tiles_fast()
        monkeypatch.setenv("INFER_DEQUANT", "eager")
        eager = lin._dequant_tile_t(0, 256, torch.bfloat16)
        eager_product = lin._product(x, False, 0)
    form = "paired" if lin.paired else f"{lin.planes} plane(s){' split' if split else ''}"
    assert packaged is not None
    print(f"\n{qtype.name} ({form}): packaged tile == eager {torch.equal(packaged, eager)}, "
          f"product == eager {torch.equal(product, eager_product)}")  # fmt: skip
    assert torch.equal(packaged, eager)
    assert torch.equal(product, eager_product)
    assert "-compiled" in lin.route_form()  # its route is measured with the one-pass tiles' cost


@pytest.mark.slow
def test_the_background_builder_builds_a_tile_and_a_process_picks_it_up(
    cache: Path, monkeypatch: pytest.MonkeyPatch, reap_processes: Callable[[], list[int]]
) -> None:
    """As a user's process gets them: a tile runs eagerly, its package is built by the builder
    (a worker process), and the next look finds it and gives the eager tile bitwise."""
    monkeypatch.setenv("INFER_AOT", "on")
    monkeypatch.setenv("INFER_BUILD_WHEN_BUSY", "1")  # the rest of the suite keeps the CPUs busy
    lin = _module(T.Q4_0)
    fn, args = _call(lin)
    assert tiles.run(fn, *args) is None
    t0 = time.perf_counter()
    while aot.building(cache) and time.perf_counter() - t0 < 600:
        time.sleep(0.5)
    log = (cache / builder.LOG).read_text()
    print(f"\nbuilder after {time.perf_counter() - t0:.0f} s:\n{log}")
    assert "built after" in log
    time.sleep(tile_packages.RECHECK_S)
    with torch.inference_mode():
        packaged = tiles.run(fn, *args)
        monkeypatch.setenv("INFER_DEQUANT", "eager")
        eager = lin._dequant_tile_t(0, 2 * int4.BLOCK_N, torch.bfloat16)
    assert packaged is not None and torch.equal(packaged, eager)
