"""The measured routes of packed products (`infer.quant.routes`): every route exact against
`dequantize` for every form, the crossover measured once per form and CPU and kept in a table keyed
by the CPU, and what the table says is what a product does."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from test_quant_linear import QUANTIZED, rel_err

from infer.quant import QuantizedLinear, dequantize, int4, routes
from infer.quant.routes import Route
from infer.testing import random_gguf

T = GGMLQuantizationType


@pytest.fixture
def table_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty routes directory of this test's own (the table is read once per file and process)."""
    monkeypatch.setenv("INFER_ROUTES_DIR", str(tmp_path / "routes"))
    routes.forget()
    yield tmp_path / "routes"
    routes.forget()


def _module(qtype: T, n: int = 200, k: int = 512, compute: torch.dtype = torch.bfloat16) -> QuantizedLinear:
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4):
        k = 96
    return QuantizedLinear.from_gguf(
        random_gguf(qtype, n, k, int(qtype)), qtype, (n, k), compute_dtype=compute
    )


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
def test_every_route_is_exact_against_dequantize(qtype: T, compute: torch.dtype) -> None:
    """The kernel, the tiles through MKL's matmul and the tiles through oneDNN's linear all compute
    ``x @ dequantize(W).T`` (float32: to float32 rounding; bfloat16 activations: to theirs), at the
    row counts of decode steps, verify passes and prompt chunks."""
    lin = _module(qtype, compute=compute)
    n, k = lin.out_features, lin.in_features
    raw = random_gguf(qtype, n, k, int(qtype))
    exact = dequantize(raw, qtype, (n, k))
    gemms = routes.GEMMS if routes.onednn_available() else ("matmul",)
    errors = {}
    for m in (1, 5, 17, 130):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = F.linear(x.to(compute).float(), exact)
        with torch.inference_mode():
            if lin.use_kernel:
                errors[f"kernel {m}"] = rel_err(lin._product(x.to(compute), True, 0), want)
            for how in gemms:
                errors[f"tiles/{how} {m}"] = rel_err(lin._product(x.to(compute), False, 0, how), want)
    worst = max(errors.values())
    print(f"{qtype.name} {compute} ({lin.fmt}, planes {lin.planes}): max relative error {worst:.1e}")
    bound = 1e-5 if compute == torch.float32 else 2e-2  # bfloat16 scales and outputs
    assert max(errors.values()) < bound, errors


def test_the_crossover_is_measured_once_per_form_and_kept_by_cpu(
    table_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first product past `routes.ROUTE_FLOOR` rows measures its form and writes the table; a
    second module of the same form, and a later process (a fresh table object), read it; another
    thread count is another CPU key, so another file."""
    calls: list[str] = []
    real = QuantizedLinear._measure_route

    def counted(self: QuantizedLinear) -> Route:
        calls.append(self.route_form())
        return real(self)

    monkeypatch.setattr(QuantizedLinear, "_measure_route", counted)
    a, b = _module(T.Q4_K), _module(T.Q4_K, n=320)
    x = torch.randn(40, a.in_features)
    with torch.inference_mode():
        a(x), b(x), a(x[:3])
    assert calls == [a.route_form()]
    files = list(table_dir.glob("*.json"))
    assert [f.name for f in files] == [f"{routes.cpu_key()}.json"]
    saved = json.loads(files[0].read_text())
    route = saved["routes"][a.route_form()]
    print(f"\n{a.route_form()}: kernel up to {route['kernel_max_rows']} rows, tiles by {route['gemm']}")
    assert route["tiles_ms"] and (route["kernel_ms"] or not a.use_kernel)
    routes.forget()
    with torch.inference_mode():
        _module(T.Q4_K)(x)
    assert calls == [a.route_form()]  # read back, not measured again
    threads = torch.get_num_threads()
    key = routes.cpu_key()
    try:
        torch.set_num_threads(threads + 1)
        assert routes.cpu_key() != key
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel_max_rows", [0, 1000])
def test_a_product_takes_the_route_the_table_names(
    table_dir: Path, monkeypatch: pytest.MonkeyPatch, kernel_max_rows: int
) -> None:
    """What the table says decides: a 40-row product runs the packed kernel when the table puts the
    crossover above 40 rows, the tiles through the named GEMM when below; products of at most
    `routes.ROUTE_FLOOR` rows take the kernel whatever the table says."""
    lin = _module(T.Q4_K)
    if not lin.use_kernel:
        pytest.skip("torch's int4 CPU kernel is not usable here: one route only")
    routes.table().put(lin.route_form(), Route(kernel_max_rows, "matmul", {}, {}))
    kernel_calls: list[int] = []
    gemm_calls: list[str] = []
    real_kernel, real_gemm = int4.cpu_matmul, routes.gemm

    def kernel(x: torch.Tensor, *args: torch.Tensor | int) -> torch.Tensor:
        kernel_calls.append(x.shape[0])
        return real_kernel(x, *args)  # type: ignore[arg-type]

    def gemm(x: torch.Tensor, w_t: torch.Tensor, how: str) -> torch.Tensor:
        gemm_calls.append(how)
        return real_gemm(x, w_t, how)

    monkeypatch.setattr(int4, "cpu_matmul", kernel)
    monkeypatch.setattr(routes, "gemm", gemm)
    with torch.inference_mode():
        lin(torch.randn(40, lin.in_features))
        lin(torch.randn(routes.ROUTE_FLOOR, lin.in_features))
    if kernel_max_rows >= 40:
        assert kernel_calls == [40, routes.ROUTE_FLOOR] and not gemm_calls
    else:
        assert kernel_calls == [routes.ROUTE_FLOOR] and gemm_calls and set(gemm_calls) == {"matmul"}


def test_routes_off_and_a_damaged_table(table_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``INFER_ROUTES=off`` measures nothing (the fixed bounds); a damaged table file is measured
    over, not an error; a bad ``INFER_ROUTES`` is named."""
    measured: list[str] = []

    def measure(self: QuantizedLinear) -> Route:
        measured.append(self.route_form())
        return Route(1, "matmul", {}, {})

    monkeypatch.setattr(QuantizedLinear, "_measure_route", measure)
    lin = _module(T.Q4_0)
    monkeypatch.setenv("INFER_ROUTES", "off")
    assert lin.route() is None
    monkeypatch.setenv("INFER_ROUTES", "on")
    table_dir.mkdir(parents=True)
    (table_dir / f"{routes.cpu_key()}.json").write_text("{not json")
    assert lin.route() == Route(1, "matmul", {}, {}) and measured == [lin.route_form()]
    monkeypatch.setenv("INFER_ROUTES", "sometimes")
    with pytest.raises(ValueError, match="INFER_ROUTES must be 'on' or 'off', got 'sometimes'"):
        _module(T.Q4_0).route()


def test_the_crossover_is_where_the_measured_lines_meet() -> None:
    """`routes.measure` on made-up costs: a kernel of 1 ms a row against tiles of 20.25 ms + 0.5 ms a
    row meet at 40.5 rows; the faster GEMM at the widest point is kept; a form without a kernel gets
    none."""

    costs: dict[str, Callable[[int], float]] = {
        "kernel": lambda m: 1.0 * m,
        "matmul": lambda m: 20.25 + 0.5 * m,
        "onednn": lambda m: 21 + 0.6 * m,
    }
    clock = [0.0]

    def fake(kind: str, m: int) -> Callable[[], object]:
        def run() -> None:
            clock[0] += costs[kind](m) / 1e3

        return run

    def now() -> float:
        return clock[0]

    route = routes.measure(lambda m: fake("kernel", m), lambda m, how: fake(how, m), clock=now)
    none = routes.measure(None, lambda m, how: fake(how, m), clock=now)
    print(f"\nkernel {route.kernel_ms}\ntiles {route.tiles_ms}")
    assert route.kernel_max_rows == 40 and route.gemm == "matmul"
    assert none.kernel_max_rows == 0 and not none.kernel_ms
