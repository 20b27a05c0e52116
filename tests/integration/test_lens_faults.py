"""`infer.lens` refusing what it cannot do, up front, with errors naming the argument, the point,
what was expected and what was found (a tiny Llama: 3 blocks, d_model 64, 4 heads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
import infer.lens as lens
from infer.lens.sae import SAE, run_with_cache_with_saes, run_with_saes

IDS = torch.tensor([[5, 6, 7, 8, 9]])
POINT = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infer.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("lensfaults"), "llama")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> infer.LLM:
    return infer.load(ckpt, dtype=torch.float32, compile=False)


def _save(llm: infer.LLM, inputs: Any, names: Any, out: Path, **kw: Any) -> Path:
    return lens.save_activations(llm, inputs, names, out, progress=False, **kw)


def _sae(d_in: int, point: str) -> SAE:
    g = torch.Generator().manual_seed(0)
    w = {
        "W_enc": torch.randn(d_in, 16, generator=g),
        "b_enc": torch.zeros(16),
        "W_dec": torch.randn(16, d_in, generator=g),
        "b_dec": torch.zeros(d_in),
    }
    return SAE(w, "standard", point)


def test_save_refuses_points_without_a_row_per_token(llm: infer.LLM, tmp_path: Path) -> None:
    for name in ("blocks.0.attn.hook_pattern", "blocks.1.attn.hook_attn_scores"):
        with pytest.raises(
            ValueError, match=rf"{name} is \[batch, head, query, key\], not one row per token"
        ):
            _save(llm, [[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]], name, tmp_path / "a")
    for name in ("unembed.hook_in", "unembed.hook_out"):
        with pytest.raises(ValueError, match=rf"{name} is the head's"):
            _save(llm, [[5, 6, 7]], name, tmp_path / "a")
    assert not (tmp_path / "a").exists()  # refused before anything was written
    # the per-token internal points are fine: [tokens, H, hd]
    acts = lens.Activations(_save(llm, [[5, 6, 7, 8, 9]], "blocks.0.attn.hook_rot_q", tmp_path / "q").parent)
    assert acts.sequence(0)["blocks.0.attn.hook_rot_q"].shape == (5, 4, 16)


def test_resume_refuses_another_data_set(llm: infer.LLM, tmp_path: Path) -> None:
    out = tmp_path / "acts"
    first = [[5, 6, 7, 8, 9], [1, 2, 3]]
    _save(llm, first, POINT, out, shard_bytes=1, batch_size=1)  # a shard a sequence
    before = json.loads((out / "index.json").read_text())
    _save(llm, first, POINT, out)  # a true resume: nothing to do, nothing changes
    assert json.loads((out / "index.json").read_text())["shards"] == before["shards"]
    with pytest.raises(
        ValueError, match=r"acts: shard-00001\.safetensors holds sequences 1\.\.1 of other token"
    ):
        _save(llm, [[5, 6, 7, 8, 9], [3, 2, 1]], POINT, out)
    with pytest.raises(ValueError, match=r"acts: holds sequences 1\.\.1 .* these inputs end after 1"):
        _save(llm, [[5, 6, 7, 8, 9]], POINT, out)
    with pytest.raises(ValueError, match=r"acts: holds activations of another data set \(names differ"):
        _save(llm, first, "blocks.1.hook_resid_post", out)
    with pytest.raises(ValueError, match=r"\(dtype differ"):
        _save(llm, first, POINT, out, dtype=torch.float16)
    # an interrupted run (its index lists one shard of two) goes on with the same inputs
    index = json.loads((out / "index.json").read_text())
    index["shards"] = index["shards"][:1]
    index.pop("complete")
    (out / "index.json").write_text(json.dumps(index))
    _save(llm, first, POINT, out)
    acts = lens.Activations(out)
    _, cache = lens.run_with_cache(llm, [[1, 2, 3]], POINT)
    assert len(acts) == 2 and torch.equal(acts.sequence(1)[POINT], cache[POINT][0])


def test_save_inputs_and_arguments(llm: infer.LLM, tmp_path: Path) -> None:
    text = "hello world"
    acts = lens.Activations(_save(llm, text, POINT, tmp_path / "t").parent)  # one text: one sequence
    _, cache = lens.run_with_cache(llm, text, POINT)
    assert len(acts) == 1 and torch.equal(acts.sequence(0)[POINT], cache[POINT][0])
    assert len(lens.Activations(_save(llm, [5, 6, 7], POINT, tmp_path / "ids").parent)) == 1
    assert len(lens.Activations(_save(llm, torch.tensor([5, 6, 7]), POINT, tmp_path / "tensor").parent)) == 1
    with pytest.raises(TypeError, match=r"dtype: expected None or a floating torch.dtype .* got 'float16'"):
        _save(llm, [[5, 6, 7]], POINT, tmp_path / "x", dtype="float16")
    for bad in (True, 0, 1.5):
        with pytest.raises(ValueError, match=r"batch_size must be an int >= 1"):
            _save(llm, [[5, 6, 7]], POINT, tmp_path / "x", batch_size=bad)
    with pytest.raises(TypeError, match=r"inputs\[1\]: expected a text or a non-empty list of token ids"):
        _save(llm, [[5, 6], 7], POINT, tmp_path / "x")
    bad_index = tmp_path / "corrupt"
    bad_index.mkdir()
    for text_ in ("{bad", "[1]", '{"names": [], "shards": [{"file": 1}]}'):
        (bad_index / "index.json").write_text(text_)
        with pytest.raises(ValueError, match=r"corrupt/index.json: not (a valid|an) activations index"):
            _save(llm, [[5, 6, 7]], POINT, bad_index)
        with pytest.raises(ValueError, match=r"corrupt/index.json: not (a valid|an) activations index"):
            lens.Activations(bad_index)


def test_points_a_run_never_reaches_are_errors(llm: infer.LLM) -> None:
    def keep(x: torch.Tensor, h: Any) -> None:
        return None

    past = r"blocks\.2\.hook_resid_post is never reached in this run: stop_at_layer=1 runs blocks 0\.\.0 only"
    with pytest.raises(ValueError, match=rf"fwd_hooks\[0\]: {past}"):
        lens.run_with_hooks(llm, IDS, [("blocks.2.hook_resid_post", keep)], stop_at_layer=1)
    with pytest.raises(ValueError, match=rf"names_filter: {past}"):
        lens.run_with_cache(llm, IDS, "blocks.2.hook_resid_post", stop_at_layer=1)
    with pytest.raises(
        ValueError, match=r"unembed\.hook_out is never reached .* return_type=None never runs"
    ):
        lens.run_with_cache(llm, IDS, "unembed.hook_out", return_type=None)
    with pytest.raises(
        ValueError, match=r"ln_final\.hook_normalized is never reached .* stop_at_layer=3 returns"
    ):
        lens.run_with_cache(llm, IDS, "ln_final.hook_normalized", stop_at_layer=3)
    with pytest.raises(ValueError, match=r"predicate|never reached"):
        lens.run_with_cache(llm, IDS, lambda n: n.startswith("blocks.2."), stop_at_layer=1)
    with pytest.raises(ValueError, match=r"saes\[0\]|splices\['blocks\.2\.hook_resid_post'\]: blocks\.2"):
        run_with_cache_with_saes(llm, IDS, [_sae(64, "blocks.2.hook_resid_post")], POINT, stop_at_layer=1)
    # what a stopped run reaches: a filter keeps those points, the returned residual is cached too
    resid, cache = lens.run_with_cache(llm, IDS, lambda n: n.endswith("resid_post"), stop_at_layer=2)
    assert sorted(cache) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    resid, cache = lens.run_with_cache(llm, IDS, "blocks.1.hook_resid_pre", stop_at_layer=1)
    assert torch.equal(resid, cache["blocks.1.hook_resid_pre"])


def test_names_filter_and_hook_results(llm: infer.LLM) -> None:
    for bad, found in ((5, r"got 5 \(int\)"), (False, "got False"), (b"x", r"\(bytes\)")):
        with pytest.raises(TypeError, match=rf"names_filter: expected None .*{found}"):
            lens.run_with_cache(llm, IDS, bad)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"returned shape \(1, 5, 64\) torch.float32 on meta; expected .* on cpu"
    ):
        lens.run_with_hooks(llm, IDS, [(POINT, lambda x, h: x.to("meta"))])


def test_sae_width_is_checked(llm: infer.LLM) -> None:
    with pytest.raises(ValueError, match=rf"saes\[0\]: the SAE at {POINT} reads d_in=32 .* is 64 wide"):
        run_with_saes(llm, IDS, [_sae(32, POINT)])


def test_gradients_and_grad_mode(llm: infer.LLM, ckpt: Path) -> None:
    packed = infer.load(ckpt, dtype=torch.float32, compile=False, quantize="q4_0")
    with pytest.raises(ValueError, match=r"bwd_hooks: this model's weights are packed .* no backward"):
        lens.run_with_hooks(packed, IDS, bwd_hooks=[(POINT, lambda g, h: None)])
    v = torch.zeros(64, requires_grad=True)
    steer = [(POINT, lambda x, h: x + v)]
    with torch.no_grad():
        assert not lens.run_with_hooks(llm, IDS, steer).requires_grad
    with torch.enable_grad():  # the caller's mode holds (TransformerLens'): a steering vector's gradient
        lens.run_with_hooks(llm, IDS, steer)[0, -1, 3].backward()  # type: ignore[no-untyped-call]
    assert v.grad is not None and v.grad.abs().sum() > 0
    with torch.enable_grad():  # no tensor needing a gradient: no graph
        assert not lens.run_with_hooks(llm, IDS).requires_grad
    with (
        pytest.raises(ValueError, match=r"hooks\(\): bwd_hooks are never called"),
        lens.hooks(llm, bwd_hooks=[(POINT, lambda g, h: None)]),
    ):
        pass
    assert not llm.model.hooks.active()


def test_a_stream_carries_the_hooks_of_the_block_it_was_made_in(llm: infer.LLM) -> None:
    import threading

    with llm.hooks(cache=POINT) as run:
        inside = llm.stream([5, 6, 7], 3)
        pieces: list[str] = []
        reader = threading.Thread(target=lambda: pieces.extend(inside))  # another context: still hooked
        reader.start()
        reader.join()
        late = llm.stream([5, 6, 7], 3)
    kept = run.activations[0][POINT]  # the prompt, then each generated token but the last
    assert len(run.activations) == 1 and kept.shape[0] >= 3 and kept.shape[1:] == (64,)
    with pytest.raises(RuntimeError, match=r"first read after the block ended"):
        next(late)
