"""The compiled step (`infer.execution.Execution(compile=True)`) against the same code run eagerly.

One code path: `model_step` runs eagerly (the reference) or through
``torch.compile(fullgraph=True)``. On tiny models (compile cost stays small) the engine with
the compiled step must give the same greedy tokens and seeded samples as with the eager one,
and the logits it samples from (`infer.testing.trace`) within
float32 rounding at the logits' scale: ``max |compiled - eager| <= REL_BOUND * max |logit|``
(docs/numerics.md; inductor sums in its own order and has its own exp / tanh, and keeps
in float32 what eager rounds to bfloat16), and reuse its graphs for a second run of the same
buckets (on KV rows of its own). This is the CPU build of what runs on CUDA with CUDA graphs on top
(``mode="reduce-overhead"``); no GPU runs here.

Inductor's on-disk cache is the user's (``~/.cache/infer/inductor``), so a second
run of this file is faster than the first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.engine import SamplingParams
from infer.execution import Execution, StepFeed
from infer.gguf.writer import write_gguf
from infer.realmodels import smollm2_path
from infer.testing import build_tokenizer, tiny_hf_model
from infer.testing.trace import trace

PROMPTS = [[5, 9, 200, 31, 7], [44, 3, 17, 90, 12, 64, 8, 8, 120, 2, 33, 19]]  # the second passes the window
STEPS = 10
REL_BOUND = 1e-5  # the numerical contract's compiled-vs-eager bound, relative to max |logit|


def run(llm: infer.LLM, execution: Execution, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[B, STEPS]`` and logits ``[B, STEPS, V]`` of `PROMPTS` submitted together to a fresh
    engine whose steps ``execution`` runs (the prompts seeded apart when sampled)."""
    params = dataclasses.replace(params, max_tokens=STEPS, ignore_eos=True)
    rows = [params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            for i in range(len(PROMPTS))]  # fmt: skip
    traced = trace(llm, PROMPTS, rows, execution=execution)
    return torch.tensor([t.tokens for t in traced]), torch.stack([t.logits for t in traced])


def compare(llm: infer.LLM, label: str, params: SamplingParams) -> Execution:
    compiled = Execution(llm.model, compile=True)
    eager_tokens, eager_logits = run(llm, Execution(llm.model), params)
    tokens, logits = run(llm, compiled, params)
    err = (logits - eager_logits).abs().max().item()
    rows = f"{STEPS} steps x {len(PROMPTS)} rows"
    scale = eager_logits.abs().max().item()
    print(
        f"\n{label}: compiled vs eager over {rows}: max |logit diff| {err:.2e} (logits up to {scale:.1f}: "
        f"{err / scale:.1e} relative, bound {REL_BOUND:.0e})"
    )
    print(f"compile {compiled.compile_seconds:.1f} s")
    assert torch.equal(tokens, eager_tokens), label
    assert err <= REL_BOUND * scale, label
    return compiled


@pytest.fixture(scope="module")
def gemma(tiny_ckpt_factory: Callable[..., Path]) -> Iterator[infer.LLM]:
    yield infer.load(tiny_ckpt_factory("gemma3"), dtype=torch.float32)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_blocks_share_one_traced_region_per_kind_of_layer(
    tiny_ckpt_factory: Callable[..., Path], arch: str
) -> None:
    """Compiled, every block is a call of the one nested region (`infer.models.base`), traced by
    dynamo once per kind of layer (Gemma 3: sliding-window and full) and stamped out for the others:
    a layer's K/V crosses into it as one `StepKV`, a pytree node dynamo flattens and compares (an
    object it cannot compare makes it trace every layer again). Dynamo's graph only (no inductor);
    the step's tokens and logits are the eager ones."""
    from infer.execution import model_step
    from infer.sampling import Sampling

    model = infer.load(tiny_ckpt_factory(arch), dtype=torch.float32).model
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    step = torch.compile(model_step, backend=capture, fullgraph=True, dynamic=False)
    # Dynamo times each stamped-out reuse of a traced region under this key (torch._dynamo.utils).
    stamps = torch._dynamo.utils.compilation_time_metrics.setdefault("invoke_subgraph_reuse_stamp_out", [])
    stamped = len(stamps)
    ids, n_new, last = torch.tensor([[5], [9]]), torch.tensor([1, 1]), torch.tensor([0, 0])
    feed = StepFeed(ids, n_new, last, Sampling(), None, None)
    with torch.inference_mode():
        cache = model.make_cache(2, 64)
        got = step(model, cache, feed)
        cache = model.make_cache(2, 64)
        want = model_step(model, cache, feed)
    stamped = len(stamps) - stamped
    calls = [n for g in graphs for n in g.graph.nodes if "invoke_subgraph" in str(n.target)]
    bodies = {n.args[0].target for n in calls}  # the get_attr of each call's traced body
    kinds = set(model.layer_types)
    print(f"\n{arch}: {len(calls)} region calls, {len(bodies)} bodies, {stamped} stamped out without a "
          f"trace, {len(kinds)} kinds of layer")  # fmt: skip
    assert len(graphs) == 1 and len(calls) == model.config.num_hidden_layers
    assert len(bodies) == len(kinds) and stamped == len(calls) - len(kinds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.slow
def test_greedy_float32(gemma: infer.LLM) -> None:
    """A sliding window, QK-norm, a tied head, soft-capping: greedy, float32."""
    compiled = compare(gemma, "tiny gemma3 float32 greedy", SamplingParams())
    before = compiled.compile_seconds
    again, _ = run(gemma, compiled, SamplingParams())  # the same buckets: no new graph (KV rows of its own)
    assert compiled.compile_seconds == before
    assert torch.equal(again, run(gemma, Execution(gemma.model), SamplingParams())[0])


@pytest.mark.slow
def test_seeded_sampling(gemma: infer.LLM) -> None:
    """Temperature, top-k and top-p inside the step; the noise comes from the seeded generator."""
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11)
    compare(gemma, "tiny gemma3 float32 sampling", params)


@pytest.mark.slow
def test_packed_gguf_default_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed Q8_0 matrices (bfloat16 kernel products) and a Q8_0 head's greedy high-plane scan."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    hf: Any = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf.config.tie_word_embeddings = True
    hf.lm_head.weight = hf.model.embed_tokens.weight
    path = write_gguf(tmp_path / "llama-q8.gguf", hf, build_tokenizer(tmp_path / "tok"), qtype="Q8_0")
    llm = infer.load(path)
    assert getattr(llm.model.lm_head, "split", False)  # the greedy scan reads the high plane alone
    compare(llm, "tiny llama GGUF Q8_0 default dtype greedy", SamplingParams())


@pytest.mark.slow
def test_load_with_compile(tiny_ckpt_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """``infer.load(compile=True)`` generates what the eager `LLM` does (same graphs as above: cached)."""
    path = tiny_ckpt_factory("gemma3")
    llm = infer.load(path, dtype=torch.float32, compile=True)
    assert llm.compiled and not infer.load(path, dtype=torch.float32).compiled
    eager = infer.load(path, dtype=torch.float32, compile=False)
    prompts = ["Hello there", "Twelve chars"]  # the buckets of the tests above: their graphs are cached
    got = llm.generate(prompts, max_new_tokens=8)
    assert [r.token_ids for r in got] == [r.token_ids for r in eager.generate(prompts, max_new_tokens=8)]
    # Two generations advanced in turn: the engine owns the KV rows, so they never share a cache.
    one, two = (llm.stream(p, max_new_tokens=8) for p in prompts)
    a, b = [], []
    for _ in range(20):
        a.append(next(one, ""))
        b.append(next(two, ""))
    assert ["".join(a), "".join(b)] == [r.text for r in eager.generate(prompts, max_new_tokens=8)]
    with pytest.raises(ValueError, match="resident"):
        infer.load(path, compile=True, streaming=infer.StreamingConfig(memory_budget="1GB"))

    # One request decoding among rows kept for the prefix cache computes a window of one row.
    sizes: list[int] = []
    step = Execution.__call__

    def recording(self: Execution, cache: Any, feed: StepFeed) -> Any:
        sizes.append(feed.ids.shape[0])
        return step(self, cache, feed)

    monkeypatch.setattr(Execution, "__call__", recording)
    for k in range(3):  # prompts sharing no prefix with a kept row take a kept row, no new one
        llm.generate([200 + k, 17, 30, 41], max_new_tokens=3)
    monkeypatch.undo()
    assert llm.engine.slots.rows == 2  # the two streams above ran at once
    print(f"\ncompiled step batch sizes with {llm.engine.slots.rows} rows allocated: {sorted(set(sizes))}")
    assert set(sizes) == {1}


def from_repack_cache(path: Path, cache: Path, **kwargs: Any) -> infer.LLM:
    """``infer.load(path, **kwargs)`` from its repack cache entry under ``cache`` (a first load
    writes it): every packed matrix is then a view of the mapped entry, q/k/v and gate/up fused
    without a copy. Such a model's blocks failed to compile as a nested region ("Encountered
    aliasing during higher order op tracing") while its tensors were views of one storage."""
    entries = cache / "infer" / "repack"
    before = set(entries.glob("*.safetensors"))
    infer.load(path, **kwargs)  # converts, and writes the entry
    [entry] = set(entries.glob("*.safetensors")) - before
    llm = infer.load(path, **kwargs)
    attn: Any = llm.model.layers[0].self_attn
    q, k, v = (getattr(attn, n).packed for n in ("q_proj", "k_proj", "v_proj"))
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    spans = [[int(x, 16) for x in m[0].split("-")] for m in maps if m[-1] == str(entry)]
    assert any(lo <= q.data_ptr() < hi for lo, hi in spans), "q_proj is not mapped from the cache entry"
    assert k.data_ptr() == q.data_ptr() + q.nbytes and v.data_ptr() == k.data_ptr() + k.nbytes
    return llm


@pytest.fixture
def gguf_with_fused_projections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny Gemma 3 GGUF whose q/k/v and gate/up fuse on every CPU (parts of whole 64-row
    packing blocks); a private cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # GGUF's gemma3 has no soft-capping, and the query scale is head_dim's.
    hf: Any = tiny_hf_model("gemma3", query_pre_attn_scalar=32, final_logit_softcapping=None)
    return write_gguf(tmp_path / "gemma3-q8.gguf", hf, build_tokenizer(tmp_path / "tok"), qtype="Q8_0")


@pytest.mark.slow
def test_gguf_from_the_repack_cache_float32(gguf_with_fused_projections: Path, tmp_path: Path) -> None:
    """A GGUF model mapped from its repack cache compiles: the eager step's greedy tokens, float32."""
    llm = from_repack_cache(gguf_with_fused_projections, tmp_path / "cache", dtype=torch.float32)
    compare(llm, "tiny gemma3 GGUF Q8_0 from the repack cache, float32 greedy", SamplingParams())


@pytest.mark.slow
def test_gguf_from_the_repack_cache_default_mode(gguf_with_fused_projections: Path, tmp_path: Path) -> None:
    """``infer.load(gguf, compile=True)`` from the repack cache generates in the default mode."""
    llm = from_repack_cache(gguf_with_fused_projections, tmp_path / "cache", compile=True)
    assert llm.compiled
    got = llm.generate("Hello there", max_new_tokens=6)
    print(f"\ncompiled, default mode: {got.token_ids}")
    assert len(got.token_ids) == 6


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_from_the_repack_cache_default_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped SmolLM2 (Q4_1 GGUF) from its repack cache: ``compile=True`` generates."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    llm = from_repack_cache(smollm2_path(), tmp_path / "cache", compile=True)
    got = llm.generate("The history of Paris begins with", max_new_tokens=8)
    print(f"\nSmolLM2 compiled, default mode: {got.text!r}")
    assert len(got.token_ids) == 8


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_from_the_repack_cache_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and in float32 the compiled step gives the eager step's greedy tokens (the compile of
    float32's dequantizing products is the slow part: ~450 s on 2 busy cores)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    llm = from_repack_cache(smollm2_path(), tmp_path / "cache", dtype=torch.float32)
    compare(llm, "SmolLM2 Q4_1 from the repack cache, float32 greedy", SamplingParams())
