"""`QuantizedLinear`: a drop-in ``nn.Linear`` whose weight stays packed (``int4``, ``int8`` or ``dense``).

Small products run torch's packed CPU kernel on bfloat16 activations; larger ones (prefill),
float32 compute and other devices dequantize tile by tile into a dense matmul. Every path computes
with the same effective weight (`effective_weight`). Formats, routes and numbers:
docs/quantization.md, "How each type is held and computed".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from infer.host import rows as row_rules
from infer.host.filemap import span
from infer.host.pages import drop_mapped_pages
from infer.quant import int4, routes, tiles
from infer.quant.dequant import dequantize
from infer.quant.ggml import FLOAT_TYPES, QType, as_rows, check_supported
from infer.quant.head import GREEDY_CANDIDATES, GREEDY_MAX_ROWS, RESCORE_TOP_K, top_indices
from infer.quant.int8 import int8_kernel_accepts
from infer.quant.planes import (
    GROUP,
    compose_paired,
    has_int4_form,
    is_paired,
    num_planes,
    pair_input,
    to_planes,
)
from infer.quant.quantize import quantize_int8_per_channel
from infer.quant.routes import ROUTE_FLOOR, Route

# Rows up to which a product runs the packed kernel, by format (int4: by planes), in compiled steps
# and under ``INFER_ROUTES=off``; an eager product of more than `routes.ROUTE_FLOOR` rows takes the
# route measured on the running CPU (`infer.quant.routes`). Measurements: docs/quantization.md.
KERNEL_MAX_ROWS = {"int4": 96, "int4 planes": 48, "int8": 16}
_TILE_VALUES = 1 << 20  # values per dequantized tile (2 MiB in bfloat16: stays in L2) ...
_MIN_TILE_COLUMNS = 256  # ... but never fewer columns than this (a narrow GEMM wastes its blocking)
_CALIBRATION_COLUMNS = 1024  # the columns of a weight its route is measured on (time scales with them)
_CONVERT_ROWS = 4096  # rows converted at a time when packing (bounds the temporaries)


def _cpu_has_bf16_gemm() -> bool:
    cpu = getattr(torch, "cpu", None)
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return True  # unknown: keep bfloat16 tiles


# Read once, at import: a compiled graph (or a nested compile region, where dynamo refuses torch's
# CPU queries) takes it as a constant.
_NATIVE_BF16_GEMM = _cpu_has_bf16_gemm()


def native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX); without it
    oneDNN emulates them, so dequantized tiles are multiplied in float32 (docs/quantization.md)."""
    return _NATIVE_BF16_GEMM


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)``, but a view when the parts already lie one after another in one
    mapped file along dim 0 (matrices the repack cache wrote side by side: no copy, no second set
    of pages). The view has a storage of its own (`infer.host.filemap.span`): a compiled block's
    weights must not share one."""
    first = parts[0]
    same = all(p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts)
    flat = span(parts) if dim == 0 and same else None
    if flat is None:
        return torch.cat(parts, dim=dim)
    rows = sum(p.shape[0] for p in parts)
    return flat.view(first.dtype).view(rows, *first.shape[1:])  # [rows, *trailing], contiguous


def _within(t: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether ``t``'s bytes lie inside one of ``tensors`` (a part joined by a view, not copied)."""
    lo = t.data_ptr()
    return any(f.data_ptr() <= lo and lo + t.nbytes <= f.data_ptr() + f.nbytes for f in tensors)


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W [out_features, in_features]`` held packed.

    Build with `from_gguf`, `from_int8` or `infer.quant.quantize_linear`; ``forward``
    takes ``x [..., in_features]`` of any float dtype and returns ``[..., out_features]``
    in x's dtype.
    """

    fmt: str
    planes: int
    paired: bool  # int4 in the paired form (groups of 16, `infer.quant.planes`): input paired, not repeated
    tile_rows: int = 0  # the deterministic mode's fixed row tiles (`infer.host.rows`); 0: free shapes
    # Buffers, present per format: int4 -> packed, scale_zero; int8 -> qweight, scales; dense -> weight.
    packed: torch.Tensor
    scale_zero: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    weight: torch.Tensor
    scale_zero_residual: torch.Tensor  # int4 output heads only: float32 scales - scale_zero, for `rescore`
    packed_hi: torch.Tensor  # Q8_0 output heads: the high plane on its own (``packed`` holds the low one)
    scale_zero_fast: torch.Tensor  # ... and its scale/zero when it alone approximates the weight

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        tensors: dict[str, torch.Tensor],
        *,
        bias: torch.Tensor | None = None,
        planes: int = 1,
        paired: bool = False,
        source: str = "",
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if fmt not in ("int4", "int8", "dense"):
            raise ValueError(f"unknown QuantizedLinear format {fmt!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.planes = planes
        self.paired = paired
        self.split = "packed_hi" in tensors  # planes held as separate packed matrices
        self.source = source  # e.g. "Q4_1", "q4_0", "int8"
        self.compute_dtype = compute_dtype
        # The packed kernels are fast only on bfloat16 activations (10-30x slower in float32).
        self.use_kernel = compute_dtype == torch.bfloat16 and (
            fmt == "int8" or (fmt == "int4" and int4.cpu_kernel_usable())
        )
        for key, value in tensors.items():
            self.register_buffer(key, value)
        self.bias: nn.Parameter | None = None
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    # ---- constructors ---------------------------------------------------------

    @classmethod
    def from_gguf(
        cls,
        raw: torch.Tensor,
        qtype: int | QType,
        shape: tuple[int, ...] | list[int],
        bias: torch.Tensor | None = None,
        *,
        name: str = "tensor",
        compute_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        exact_rescoring: bool = False,
    ) -> QuantizedLinear:
        """From the bytes of a GGUF weight of ``shape = (out_features, in_features)`` (torch order).

        ``raw`` (uint8, e.g. a view of the memory-mapped file) is converted, not kept.
        ``name`` is used in error messages. ``exact_rescoring`` (for an output head with a
        compute dtype below float32) also keeps what the compute-dtype scales lost (their
        residual, in bfloat16: exact for fp16 GGUF scales, to 2^-17 for products of
        scales) and re-scores each row's top outputs exactly (`rescore`).
        """
        qt = check_supported(qtype, name)
        n, k = (int(s) for s in shape)
        device = torch.device(device) if device is not None else raw.device
        bias = bias.to(device) if bias is not None else None
        if qt in FLOAT_TYPES or not has_int4_form(qt):
            w = dequantize(raw, qt, (n, k), name=name).to(device=device, dtype=compute_dtype)
            return cls(k, n, "dense", {"weight": w}, bias=bias, source=qt.name, compute_dtype=compute_dtype)
        rows = as_rows(raw, qt, n, k, name)
        p = num_planes(qt)
        n_pad = _round_up(n, int4.ROW_MULTIPLE)
        kp = p * k
        exact = exact_rescoring and compute_dtype != torch.float32
        # A Q8_0 head's high plane (q >> 4, 4 bits) alone is a fair approximation of the weight:
        # it is held on its own, so greedy decoding scans half the bytes (`greedy`).
        split = exact and qt == QType.Q8_0
        widths = [k] * p if split else [kp]
        packed = [torch.empty(n_pad, w // 2, dtype=torch.uint8, device=device) for w in widths]
        scale_zero = torch.zeros(kp // GROUP, n_pad, 2, dtype=compute_dtype, device=device)
        scale_zero_f32 = (
            torch.zeros(kp // GROUP, n_pad, 2, dtype=torch.float32, device=device) if exact else None
        )
        for start in range(0, n, _CONVERT_ROWS):  # a multiple of 64: packing blocks stay whole
            stop = min(n, start + _CONVERT_ROWS)
            nib, scale, zero = to_planes(rows[start:stop].to(device), qt, k)
            if stop == n and n_pad != n:  # pad the last rows to the kernel's multiple of 16
                nib = torch.cat([nib, torch.full((n_pad - n, kp), 8, dtype=torch.uint8, device=device)])
                stop = n_pad
            for i, target in enumerate(packed):
                target[start:stop] = int4.pack(nib[:, i * k : i * k + target.shape[1] * 2])
            scale_zero[:, start : start + scale.shape[0], 0] = scale.T.to(compute_dtype)
            scale_zero[:, start : start + zero.shape[0], 1] = zero.T.to(compute_dtype)
            if scale_zero_f32 is not None:
                scale_zero_f32[:, start : start + scale.shape[0], 0] = scale.T.to(torch.float32)
                scale_zero_f32[:, start : start + zero.shape[0], 1] = zero.T.to(torch.float32)
        tensors = {"packed": packed[0], "scale_zero": scale_zero}
        if scale_zero_f32 is not None:
            residual = scale_zero_f32 - scale_zero.to(torch.float32)
            tensors["scale_zero_residual"] = residual.to(torch.bfloat16)
        if split:
            # The low plane is ((q & 15) - 8) * d + 8d: on average 7.5d, folded into the high plane's zero.
            lo_scale = scale_zero_f32[: k // GROUP, :, 0]  # type: ignore[index]
            fast = scale_zero_f32[k // GROUP :].clone()  # type: ignore[index]
            fast[..., 1] += 7.5 * lo_scale
            tensors |= {"packed_hi": packed[1], "scale_zero_fast": fast.to(compute_dtype)}
        return cls(
            k, n, "int4", tensors, bias=bias, planes=p, paired=is_paired(qt), source=qt.name,
            compute_dtype=compute_dtype,
        )  # fmt: skip

    @classmethod
    def from_int8(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> QuantizedLinear:
        """Weight-only int8, symmetric per output channel (``quantize="int8"``)."""
        q, scale = quantize_int8_per_channel(weight, compute_dtype)
        n, k = q.shape
        tensors = {"qweight": q, "scales": scale}
        return cls(k, n, "int8", tensors, bias=bias, source="int8", compute_dtype=compute_dtype)

    @classmethod
    def concat(cls, parts: list[QuantizedLinear]) -> QuantizedLinear | None:
        """One module computing ``parts`` side by side (q/k/v, gate/up), or None when they cannot
        share one packed matrix; the parts then hold views of its buffers."""
        first = parts[0]
        same = all(
            p.fmt == first.fmt
            and p.in_features == first.in_features
            and p.planes == first.planes
            and p.paired == first.paired
            and p.compute_dtype == first.compute_dtype
            and not p.split
            and not hasattr(p, "scale_zero_residual")
            and (p.bias is None) == (first.bias is None)
            for p in parts
        )
        if not same:
            return None
        if first.fmt == "int4":  # whole 64-row packing blocks, no padding rows in between
            inner = any(p.out_features % int4.BLOCK_N for p in parts[:-1])
            if inner or parts[-1].packed.shape[0] != parts[-1].out_features:
                return None
            names, dims = ["packed", "scale_zero"], [0, 1]
        elif first.fmt == "int8":
            names, dims = ["qweight", "scales"], [0, 0]
        else:
            names, dims = ["weight"], [0]
        pairs = list(zip(names, dims, strict=True))
        tensors = {name: _joined([getattr(p, name) for p in parts], dim) for name, dim in pairs}
        bias = torch.cat([p.bias for p in parts]) if first.bias is not None else None  # type: ignore[misc]
        n = sum(p.out_features for p in parts)
        source = "+".join(sorted({p.source for p in parts}))
        fused = cls(
            first.in_features, n, first.fmt, tensors, bias=bias, planes=first.planes, paired=first.paired,
            source=source, compute_dtype=first.compute_dtype,
        )  # fmt: skip
        originals = [getattr(p, name) for p in parts for name, _ in pairs]
        start = 0
        for p in parts:
            stop = start + p.out_features
            for name, dim in pairs:
                setattr(p, name, getattr(fused, name).narrow(dim, start, stop - start))
            if p.bias is not None and fused.bias is not None:
                p.bias = nn.Parameter(fused.bias[start:stop], requires_grad=False)
            start = stop
        # Parts mapped from a file (the repack cache) and copied are now read from the fused copy:
        # their pages need not stay resident beside it (those joined as a view are the fused bytes).
        drop_mapped_pages([t for t in originals if not _within(t, list(tensors.values()))])
        return fused

    # ---- forward --------------------------------------------------------------

    @property
    def kernel_max_rows(self) -> int:
        """Rows up to which a product runs the packed kernel (`KERNEL_MAX_ROWS`)."""
        if self.fmt == "int4":
            return KERNEL_MAX_ROWS["int4 planes" if self.planes > 1 else "int4"]
        return KERNEL_MAX_ROWS.get(self.fmt, 0)

    def route_form(self) -> str:
        """What a product's route depends on besides the CPU: the format, planes, pairing, ``K`` and
        the compute and tile dtypes (the key of `infer.quant.routes.RouteTable`)."""
        tile = self._tile_dtype(torch.empty(0, dtype=self.compute_dtype))
        pairing = "paired" if self.paired else ("split" if self.split else "plain")
        dtypes = "-".join(str(d).removeprefix("torch.") for d in (self.compute_dtype, tile))
        compiled = "-compiled" if self.fmt == "int4" and self._tiles_fast() else ""  # (tiles' cost)
        return f"{self.fmt}-p{self.planes}-{pairing}-k{self.in_features}-{dtypes}{compiled}"

    def route(self) -> Route | None:
        """The route of this module's products of many rows on this CPU (measured now if its form is
        new); None where nothing is measured (``INFER_ROUTES=off``, a dense weight, another device)."""
        if self.fmt == "dense" or self.packed_device_type() != "cpu" or not routes.enabled():
            return None
        form = self.route_form()
        cached: tuple[str, Route] | None = self.__dict__.get("_route")
        if cached is not None and cached[0] == form:  # (the form changes once its tiles' packages load)
            return cached[1]
        found = routes.table().get(form)
        if found is None:
            print(f"infer: measuring the matrix-product routes of {form} on this CPU (once; "
                  f"{routes.routes_dir()})", file=sys.stderr, flush=True)  # fmt: skip
            found = self._measure_route()
            routes.table().put(form, found)
        self.__dict__["_route"] = (form, found)
        return found

    def packed_device_type(self) -> str:
        return next(self.buffers()).device.type

    def _measure_route(self) -> Route:
        """Time both routes on this weight's first `_CALIBRATION_COLUMNS` outputs (`routes.measure`)."""
        part = self._calibration_part()
        gemms = routes.GEMMS if routes.onednn_available() else ("matmul",)

        def rows(m: int) -> torch.Tensor:
            return torch.randn(m, self.in_features, generator=torch.Generator().manual_seed(m)).to(
                self.compute_dtype
            )

        def kernel(m: int) -> Callable[[], object]:
            x = rows(m)
            return lambda: part._product(x, True, 0)

        def tiles(m: int, how: str) -> Callable[[], object]:
            x = rows(m)
            return lambda: part._product(x, False, 0, how)

        with torch.inference_mode():
            return routes.measure(kernel if self.use_kernel else None, tiles, gemms)

    def _calibration_part(self) -> QuantizedLinear:
        """A module computing this one's first outputs (at most `_CALIBRATION_COLUMNS`, whole row
        blocks), on views of its weight (scales copied: small)."""
        n_rows = self.qweight.shape[0] if self.fmt == "int8" else self.packed.shape[0]
        n = min(n_rows, _CALIBRATION_COLUMNS)
        if self.fmt == "int4":  # whole tiles: the part's tiles take the shapes (the kernels) of this one's
            n = min(n_rows, max(n, self._tile_spans()[0][1]))
        if self.fmt == "int8":
            tensors = {"qweight": self.qweight[:n], "scales": self.scales[:n].contiguous()}
        else:
            tensors = {"packed": self.packed[:n], "scale_zero": self.scale_zero[:, :n].contiguous()}
            if self.split:
                tensors["packed_hi"] = self.packed_hi[:n]
        return QuantizedLinear(
            self.in_features, n, self.fmt, tensors, planes=self.planes, paired=self.paired,
            source=self.source, compute_dtype=self.compute_dtype,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)  # [M, K]
        kernel = self.use_kernel and x2.is_cpu
        if not self.tile_rows:
            m = x2.shape[0]
            measured = None
            if m > ROUTE_FLOOR and x2.is_cpu and not torch.compiler.is_compiling():
                measured = self.route()
            if measured is None:
                y = self._product(x2, kernel and m <= self.kernel_max_rows, 0, out_dtype=x.dtype)
            else:
                y = self._product(x2, kernel and m <= measured.kernel_max_rows, 0, measured.gemm, x.dtype)
        elif kernel:  # the deterministic mode: every tile on the kernel
            y = row_rules.tiled(x2, lambda t: self._product(t, True, 0), self.tile_rows)
        else:
            y = self._product(x2, False, self.tile_rows)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if hasattr(self, "scale_zero_residual"):
            y = self.rescore(x.reshape(-1, self.in_features), y)
        return y.view(*lead, self.out_features)

    def _product(
        self,
        x2: torch.Tensor,
        kernel: bool,
        tile: int,
        gemm: str = "matmul",
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``x2 [M, K] @ W.T`` in the compute dtype: the packed kernel, or dense products
        (in tiles of ``tile`` rows when ``tile``; else through ``gemm``, `routes.gemm`). ``out_dtype``:
        int4 tiles write their outputs in it (one pass: no joined copy, no conversion after)."""
        if self.fmt == "int4":
            return self._int4(x2, kernel, tile, gemm, out_dtype)
        if self.fmt == "int8":
            return self._int8(x2, kernel, tile, gemm)
        return row_rules.matmul(x2, self.weight.t(), tile)

    @staticmethod
    def _tile_product(x: torch.Tensor, w_t: torch.Tensor, tile: int, gemm: str) -> torch.Tensor:
        return row_rules.matmul(x, w_t, tile) if tile else routes.gemm(x, w_t, gemm)

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """Outputs whose per-row argmax is exact arithmetic's: for a greedy step.

        A Q8_0 head scans its high plane alone, then re-scores each row's top `GREEDY_CANDIDATES`
        exactly; the other entries stay approximate. Every other module returns ``forward(x)``.
        """
        rows = x.reshape(-1, self.in_features).shape[0]
        if self.tile_rows or not (self.split and self.use_kernel and x.is_cpu and rows <= GREEDY_MAX_ROWS):
            out: torch.Tensor = self(x)
            return out
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        xk = x2.to(self.compute_dtype).contiguous()
        if not int4.cpu_kernel_accepts(xk, self.packed_hi, GROUP, self.scale_zero_fast, usable_checked=True):
            full: torch.Tensor = self(x)
            return full
        y = int4.cpu_matmul(xk, self.packed_hi, GROUP, self.scale_zero_fast)
        y = y[:, : self.out_features].to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return self.rescore(x2, y, GREEDY_CANDIDATES).view(*lead, self.out_features)

    def rescore(self, x2: torch.Tensor, y: torch.Tensor, top_k: int = RESCORE_TOP_K) -> torch.Tensor:
        """``y [M, N]`` with each row's ``top_k`` largest outputs recomputed exactly in float32 (an
        output head: greedy choices equal exact arithmetic's when its winner is in the fast top ``top_k``)."""
        k = min(top_k, self.out_features)
        idx = top_indices(y.float(), k)  # [M, k]
        if self.tile_rows:  # the deterministic mode: each row alone, the same shapes whatever the batch
            exact = torch.cat(
                [self.exact_outputs(x2[i : i + 1], idx[i : i + 1]) for i in range(idx.shape[0])]
            )
        else:
            exact = self.exact_outputs(x2, idx)
        if self.bias is not None:
            exact = exact + self.bias.float()[idx]
        return y.scatter_(-1, idx, exact.to(y.dtype))  # y: this call's own output (no copy of the logits)

    def exact_outputs(self, x2: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Outputs ``idx [M, k]`` of each row of ``x2 [M, K]`` with the exact scales: ``[M, k]`` float32
        (no bias), what ``x2 @ exact_rows(idx).T`` gives each row.

        A Q8_0 head's two planes are one byte ``c = 16 * hi + lo``, a weight ``s * (c - 136) + z``:
        per group of 32 the bytes times the activations are summed, then scaled (no float row made).
        """
        if not self.split:
            rows = self.exact_rows(idx.reshape(-1)).view(*idx.shape, self.in_features)  # [M, k, K]
            return torch.einsum("mk,mjk->mj", x2.float(), rows)
        m, k = idx.shape
        flat = idx.reshape(-1)
        lo, hi = int4.gather_rows(self.packed, flat), int4.gather_rows(self.packed_hi, flat)  # [M*k, K]
        groups = self.in_features // GROUP
        c = (hi.to(torch.int32) * 16 + lo.to(torch.int32)).to(torch.float32).view(m, k, groups, GROUP)
        xg = x2.float().view(m, 1, groups, GROUP)
        dots, xsum = (c * xg).sum(-1), xg.sum(-1)  # [M, k, G], [M, 1, G]
        sz = self.scale_zero[:groups, flat].float() + self.scale_zero_residual[:groups, flat].float()
        sz = sz.view(groups, m, k, 2).permute(1, 2, 0, 3)  # the low plane's [M, k, G, 2]
        return (sz[..., 0] * (dots - 136 * xsum) + sz[..., 1] * xsum).sum(-1)

    def _plane_matrices(self) -> list[torch.Tensor]:
        """The packed matrices: one ``[N, P*K/2]`` (planes side by side), or one per plane when split."""
        return [self.packed, self.packed_hi] if self.split else [self.packed]

    def unpacked_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The 4-bit values of ``rows`` (``[R]`` int64): ``[R, P*K]`` uint8, planes side by side."""
        parts = [int4.gather_rows(m, rows) for m in self._plane_matrices()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def exact_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Weight rows ``[R, in_features]`` (float32) with the exact scales kept for rescoring."""
        sz = self.scale_zero[:, rows].float() + self.scale_zero_residual[:, rows].float()  # [P*K/32, R, 2]
        return self.compose(self.unpacked_rows(rows), sz)

    def compose(self, nib: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """Weight rows ``[R, K]`` float32 from their nibbles ``[R, P*K]`` (uint8, planes side by side
        or paired) and scale/zero ``[P*K/32, R, 2]`` float32."""
        n, k = nib.shape[0], self.in_features
        if self.paired:
            return compose_paired(nib, sz[..., 0].T, sz[..., 1].T)
        scale, zero = sz[..., 0].T[..., None], sz[..., 1].T[..., None]  # [R, P*K/32, 1]
        w = ((nib.to(torch.float32).view(n, -1, GROUP) - 8) * scale + zero).view(n, self.planes, k)
        return w.sum(dim=1)

    def _int4(
        self,
        x2: torch.Tensor,
        kernel: bool,
        tile: int,
        gemm: str = "matmul",
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        y: torch.Tensor | None = None
        if kernel and self.split:  # one call per plane: [M, N] each, summed in float32
            g = self.in_features // GROUP
            xk = x2.contiguous()
            lo, hi = self.scale_zero[:g], self.scale_zero[g:]
            accepts = int4.cpu_kernel_accepts(xk, self.packed, GROUP, lo, usable_checked=True)
            if accepts and int4.cpu_kernel_accepts(xk, self.packed_hi, GROUP, hi, usable_checked=True):
                y_lo = int4.cpu_matmul(xk, self.packed, GROUP, lo)
                y_hi = int4.cpu_matmul(xk, self.packed_hi, GROUP, hi)
                y = (y_lo.float() + y_hi.float()).to(x2.dtype)
        elif kernel:
            if self.paired:
                xp = pair_input(x2)  # [M, 2K]
            else:
                xp = x2.repeat(1, self.planes) if self.planes > 1 else x2.contiguous()  # [M, P*K]
            if int4.cpu_kernel_accepts(xp, self.packed, GROUP, self.scale_zero, usable_checked=True):
                y = int4.cpu_matmul(xp, self.packed, GROUP, self.scale_zero)
        if y is None:  # prefill, another device, or operands the kernel does not take
            dtype = self._tile_dtype(x2)
            xt = x2.to(dtype)
            n = self.out_features
            y = torch.empty(x2.shape[0], n, dtype=out_dtype or x2.dtype, device=x2.device)
            for a, b in self._tile_spans():  # each tile's outputs written in place (padding rows dropped)
                part = self._tile_product(xt, self._dequant_tile_t(a, b, dtype), tile, gemm)  # [M, b - a]
                if part.dtype != x2.dtype:  # (float32 tiles of bfloat16 compute: rounded as before)
                    part = part.to(x2.dtype)
                y[:, a : min(b, n)] = part[:, : min(b, n) - a]
            return y
        if y.shape[1] != self.out_features:  # rows padded to a multiple of 16
            y = y[:, : self.out_features].contiguous()
        return y

    def _tile_spans(self) -> list[tuple[int, int]]:
        """The packed rows of each dequantized tile: a power of two of them (few tile shapes, each
        a kernel of `infer.quant.tiles`), and a tail block on its own."""
        n_pad = self.packed.shape[0]
        cols = 1 << max(_MIN_TILE_COLUMNS, _TILE_VALUES // (self.planes * self.in_features)).bit_length() - 1
        full = n_pad - n_pad % int4.BLOCK_N
        spans = [(start, min(full, start + cols)) for start in range(0, full, cols)]
        return spans + ([(full, n_pad)] if full < n_pad else [])

    def _tile_dtype(self, x2: torch.Tensor) -> torch.dtype:
        """The dtype dequantized tiles are multiplied in: the compute dtype, but float32 for a
        bfloat16 one on a CPU without bfloat16 arithmetic (`native_bf16_gemm`)."""
        if self.compute_dtype == torch.bfloat16 and x2.is_cpu and not native_bf16_gemm():
            return torch.float32
        return self.compute_dtype

    def _dequant_tile_t(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Effective weight rows ``start:stop``, transposed: ``[K, rows]`` in ``dtype`` (default: the
        compute dtype).

        Unpacks to float32, scales in float32, sums the planes and rounds to ``dtype`` once.
        """
        k, r = self.in_features, stop - start
        kp = self.planes * k
        dtype = dtype or self.compute_dtype
        big = k * self.out_features >= tiles.MIN_WEIGHTS
        if big and r % int4.BLOCK_N == 0 and self.packed.is_cpu and not torch.compiler.is_compiling():
            fast = self._compiled_tile(start, stop, dtype)  # one pass (`infer.quant.tiles`)
            if fast is not None:
                return fast
        if self.paired:
            return self._dequant_paired_t(start, stop, dtype)
        if self.planes == 2 and not torch.compiler.is_compiling():
            return self._dequant_two_planes_t(start, stop, dtype)
        parts = [int4.unpack_transposed(m, start, stop, torch.float32) for m in self._plane_matrices()]
        f = parts[0] if len(parts) == 1 else torch.cat(parts)  # [P*K, rows]
        if self.planes == 1:
            scale, zero = self._tile_scales(start, stop)  # [K/32, rows]
        else:  # (in a graph: every plane's scales)
            sz = self.scale_zero[:, start:stop].to(torch.float32)  # [P*K/32, rows, 2]
            scale, zero = sz[..., 0], sz[..., 1]
        zero = zero - 8 * scale
        if torch.compiler.is_compiling():  # one fused loop
            w = (f.view(kp // GROUP, GROUP, r) * scale[:, None] + zero[:, None]).view(kp, r)
            if self.planes > 1:
                w = w.view(self.planes, k, r).sum(0)
            return w.to(dtype)
        # Eagerly: in place, no temporaries (the tile is ~1M values; each pass over it costs).
        # A multiply, then an add: the compiled loop's two roundings (addcmul would fuse them).
        # Contiguous scales: broadcasting the strided ``sz[..., 0]`` costs 2.5x the pass.
        f3 = f.view(kp // GROUP, GROUP, r)
        f3.mul_(scale[:, None]).add_(zero[:, None])
        return f.to(dtype)

    def _compiled_tile(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor | None:
        """`_dequant_tile_t` of whole row blocks through `infer.quant.tiles`' one-pass kernels (the
        same operations: equal bitwise), None where they are off, not built yet or failed."""
        call = self._tile_call(start, stop, dtype)
        if call is None:
            return None
        if self.paired and self._tiles_fast():
            self._read_in_order(start, stop)
        return tiles.run(call[0], *call[1])

    def _read_in_order(self, start: int, stop: int) -> None:
        """Read rows ``start:stop``'s packed bytes once, in memory order, as int64 words.

        The paired kernel reads each 64-row block through two pointers 512 bytes apart, which
        the hardware prefetcher follows poorly from memory (Zen 5: 2 G weights/s, against 7 in
        cache); this read (~37 GB/s) brings the tile's bytes into cache first (docs/quantization.md,
        "Dequantization in one pass"). Bytes that cannot be viewed as whole aligned words (a view
        at an odd offset) are left unread: it only costs speed.
        """
        part = self.packed[start:stop]
        if part.is_contiguous() and part.storage_offset() % 8 == 0 and part.numel() % 8 == 0:
            part.view(torch.int64).sum()

    def _tile_call(
        self, start: int, stop: int, dtype: torch.dtype
    ) -> tuple[tiles.Kernel, tuple[object, ...]] | None:
        """The `infer.quant.tiles` kernel and arguments of rows ``start:stop``'s tile."""
        k = self.in_features
        packed = self.packed[start:stop]
        scale, zero = self._tile_scales(start, stop)
        if self.paired:
            return tiles.paired, (packed, scale, zero, k, dtype)
        if self.planes == 2:
            hi = self.packed_hi[start:stop] if self.split else None
            return tiles.two_planes, (packed, hi, scale, zero, k, dtype)
        if self.planes == 1:
            return tiles.one_plane, (packed, scale, zero, k, dtype)
        return None

    def _tile_scales(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and zeros of rows ``start:stop``'s tile (two planes: the low plane's), each
        ``[groups, rows]`` float32, contiguous.

        ``scale_zero`` interleaves them (``[groups, N, 2]``). Eagerly, a bfloat16 pair read as one
        int32 widens by two integer passes over the slice (a bfloat16 is a float32's high half),
        where widening and then gathering each half takes three strided passes: a fifth of a tile.
        In a graph the plain expression fuses (inductor would scalarize the bit casts).
        """
        groups = self.in_features // (16 if self.paired else GROUP)
        sz = self.scale_zero[:groups, start:stop]
        if sz.dtype == torch.bfloat16 and sys.byteorder == "little" and not torch.compiler.is_compiling():
            bits = sz.view(torch.int32)[..., 0]  # [groups, rows]: the scale's bits low, the zero's high
            return (bits << 16).view(torch.float32), (bits & -65536).view(torch.float32)
        f = sz.to(torch.float32)
        return f[..., 0].contiguous(), f[..., 1].contiguous()

    def _tiles_fast(self) -> bool:
        """Whether this weight's tiles run in one pass (`infer.quant.tiles.fast`: compiled, or
        every shape's package loaded; a missing one is queued). Asked again at most once a second
        until true (a package built meanwhile is picked up)."""
        if self.__dict__.get("_fast_tiles"):
            return True
        now = time.monotonic()
        if now - self.__dict__.get("_fast_tiles_at", -1.0) < 1.0:
            return False
        self.__dict__["_fast_tiles_at"] = now
        if self.fmt != "int4" or self.in_features * self.out_features < tiles.MIN_WEIGHTS:
            return False
        dtype = self._tile_dtype(torch.empty(0, dtype=self.compute_dtype))
        shapes = {b - a: (a, b) for a, b in self._tile_spans() if (b - a) % int4.BLOCK_N == 0}
        calls = [self._tile_call(a, b, dtype) for a, b in shapes.values()]
        fast = bool(calls) and all([c is not None and tiles.fast(c[0], *c[1]) for c in calls])  # (all queued)
        self.__dict__["_fast_tiles"] = fast
        return fast

    def _dequant_two_planes_t(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """`_dequant_tile_t` of two planes, eagerly: their nibbles joined in one byte first.

        A weight is ``s * (lo + 16 * hi - 136) + z`` (`infer.quant.planes`): one float pass over
        ``[K, rows]`` instead of two, and ``s * (c - 136)`` is exact in float32, so it rounds once.
        """
        k, r = self.in_features, stop - start
        hi = self.packed_hi if self.split else None
        joined = int4.unpack_joined_transposed(self.packed, start, stop, k, hi)  # [K, rows] uint8
        f = joined.to(torch.float32).sub_(136.0)
        scale, zero = self._tile_scales(start, stop)  # the low plane's [K/32, rows]
        f3 = f.view(k // GROUP, GROUP, r)
        f3.mul_(scale[:, None]).add_(zero[:, None])
        return f.to(dtype)

    def _dequant_paired_t(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """`_dequant_tile_t` of the paired form: ``s * (lo + 16 * hi - 136) + 17 * z`` per value,
        ``lo`` and ``hi`` the two halves of a group of 32 packed columns (`infer.quant.planes`)."""
        k, r = self.in_features, stop - start
        nib = int4.unpack_transposed(self.packed, start, stop)  # [2K, rows] uint8
        pairs = nib.view(k // 16, 2, 16, r)
        c = torch.bitwise_left_shift(pairs[:, 1], 4).bitwise_or_(pairs[:, 0])  # [K/16, 16, rows]
        scale, zero = self._tile_scales(start, stop)  # [K/16, rows]
        zero = 17 * zero
        if torch.compiler.is_compiling():  # one fused loop
            w = (c.to(torch.float32) - 136) * scale[:, None] + zero[:, None]
            return w.reshape(k, r).to(dtype)
        f = c.to(torch.float32).sub_(136.0)
        f.mul_(scale[:, None]).add_(zero[:, None])
        return f.view(k, r).to(dtype)

    def _int8(self, x2: torch.Tensor, kernel: bool, tile: int, gemm: str = "matmul") -> torch.Tensor:
        if kernel:
            xk = x2.contiguous()
            compiling = torch.compiler.is_compiling()
            if compiling or xk.data_ptr() % 32:
                # The kernel needs 32-byte aligned rows: a view into a larger tensor is copied. In
                # a graph the pointer cannot be read: a fresh buffer (64-byte aligned) always is.
                xk = xk.clone()
            if int8_kernel_accepts(xk, self.qweight, self.scales, pointers_checked=compiling):
                return torch.ops.aten._weight_int8pack_mm(xk, self.qweight, self.scales)  # type: ignore[no-any-return]
        n = self.out_features
        cols = max(_MIN_TILE_COLUMNS, _TILE_VALUES // self.in_features // 64 * 64)
        xt = x2.to(self._tile_dtype(x2))
        parts = [
            self._tile_product(xt, self.qweight[start : min(n, start + cols)].to(xt.dtype).T, tile, gemm)
            for start in range(0, n, cols)
        ]  # int8 -> compute dtype is exact: |q| <= 127 fits bfloat16's mantissa
        y = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(x2.dtype)
        return y * self.scales

    # ---- introspection ----------------------------------------------------------

    def effective_weight(self) -> torch.Tensor:
        """The weight every path computes with, ``[out_features, in_features]`` float32."""
        n = self.out_features
        if self.fmt == "dense":
            return self.weight.to(torch.float32)
        if self.fmt == "int8":
            return self.qweight.to(torch.float32) * self.scales.to(torch.float32)[:, None]
        parts = [int4.unpack(m)[:n] for m in self._plane_matrices()]
        nib = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [N, P*K]
        return self.compose(nib, self.scale_zero[:, :n].to(torch.float32))

    def packed_nbytes(self) -> int:
        """Bytes held by the weight (packed values and scales, not the bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fmt={self.fmt}, source={self.source}, planes={self.planes}, "
            f"paired={self.paired}, "
            f"compute_dtype={self.compute_dtype}"
        )


__all__ = [
    "GREEDY_CANDIDATES",
    "GREEDY_MAX_ROWS",
    "KERNEL_MAX_ROWS",
    "RESCORE_TOP_K",
    "QuantizedLinear",
    "int8_kernel_accepts",
    "top_indices",
]
