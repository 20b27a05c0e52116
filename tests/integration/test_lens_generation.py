"""`infer.lens.hooks` during generation, with the engine batching several callers.

A request submitted inside ``llm.hooks(...)`` runs in forwards of its own row (its hooks see its
positions only); the other requests of the same steps run as without hooks (no hook acts on
their forwards, so nothing forces them eager) and give the tokens they give alone. Kept
activations (``cache=``) equal a whole-sequence `run_with_cache` of the same tokens.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import infer
import infer.execution as execution
from infer import SamplingParams

POINT = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> infer.LLM:
    from infer.testing import build_checkpoint

    path = build_checkpoint(tmp_path_factory.mktemp("lensgen"), "llama")
    return infer.load(path, dtype=torch.float32, compile=False)


def _steer(t: torch.Tensor, h: Any) -> torch.Tensor:
    return t * 1.5 + torch.linspace(-2.0, 2.0, t.shape[-1])


def _recomputed(llm: infer.LLM, prompt: list[int], n: int, hooks: list[Any]) -> list[int]:
    """Greedy tokens of a loop that recomputes the whole sequence with ``hooks`` every step."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(llm.run_with_hooks([ids], fwd_hooks=hooks)[0, -1].argmax()))
    return ids[len(prompt) :]


def _tokens(handle: Any) -> list[int]:
    for _ in handle:
        pass
    return list(handle.token_ids)


def _gen(llm: infer.LLM, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens through the engine, EOS or not."""
    return _tokens(
        llm.engine.submit_many([prompt], [SamplingParams(max_tokens=n, ignore_eos=True)], drive=True)[0]
    )


def test_hooks_see_their_callers_rows_only(llm: infer.LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hooked request and a plain one admitted into the same steps: the hook sees ``[1, T, D]``
    tensors of its request's positions (its prompt in chunks, then a token a step), its tokens are
    the recompute loop's; the plain request's forwards run with no hook acting and give its
    tokens alone."""
    a, b = list(range(3, 14)), list(range(40, 57))
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = _gen(llm, b, 8)
    steps: list[tuple[tuple[int, ...], bool]] = []
    real = execution.model_step

    def spy(model: Any, cache: Any, feed: Any) -> Any:
        steps.append((tuple(feed.ids.shape), model.hooks.active()))
        return real(model, cache, feed)

    monkeypatch.setattr(execution, "model_step", spy)
    seen: list[tuple[int, ...]] = []

    def look(t: torch.Tensor, h: Any) -> torch.Tensor:
        seen.append(tuple(t.shape))
        return _steer(t, h)

    engine = llm.engine
    other: list[Any] = []  # another caller's request, queued from its thread (outside the block)
    with llm.hooks(fwd_hooks=[(POINT, look)]):
        (ha,) = engine.submit_many([a], [greedy], drive=True)  # drive: nothing steps until we iterate
        caller = threading.Thread(target=lambda: other.extend(engine.submit_many([b], [greedy], drive=True)))
        caller.start()
        caller.join(timeout=60)
        steered = _tokens(ha)  # both run in the same steps
        hb = other[0]
    plain = _tokens(hb)
    monkeypatch.setattr(execution, "model_step", real)
    hidden = llm.config.hidden_size
    print(f"\nhook saw {seen}\nsteps (shape, hooks acting) {steps}")
    assert all(s[0] == 1 and s[2] == hidden for s in seen)
    assert sum(s[1] for s in seen) == len(a) + 8 - 1  # every position it fed, once
    assert all(shape[0] == 1 for shape, acting in steps if acting)
    assert any(not acting for _, acting in steps)
    assert plain == alone
    assert steered == _recomputed(llm, a, 8, [(POINT, _steer)])
    assert steered != _gen(llm, a, 8)


def test_two_threads_one_with_hooks(llm: infer.LLM) -> None:
    """Two callers on two threads at once, one inside ``llm.hooks``: each gets its own tokens."""
    a, b = list(range(5, 20)), list(range(60, 70))
    want_b = _gen(llm, b, 10)
    want_a = _recomputed(llm, a, 10, [(POINT, _steer)])
    got: dict[str, list[int]] = {}
    start = threading.Barrier(2)

    def hooked() -> None:
        with llm.hooks(fwd_hooks=[(POINT, _steer)]):
            start.wait()
            got["a"] = _gen(llm, a, 10)

    def plain() -> None:
        start.wait()
        got["b"] = _gen(llm, b, 10)

    threads = [threading.Thread(target=f) for f in (hooked, plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == {"a": want_a, "b": want_b}


@pytest.mark.parametrize("how", ["generate", "stream"])
def test_generation_keeps_activations(llm: infer.LLM, how: str) -> None:
    """``cache=`` keeps each request's points at every position it fed, equal to `run_with_cache`
    of the whole sequence; one result per request, in submission order."""
    names = [POINT, "blocks.0.attn.hook_z"]
    prompts = [list(range(3, 12)), list(range(20, 33))]
    with llm.hooks(cache=names) as run:
        if how == "generate":
            results = llm.generate(prompts, max_new_tokens=6)
            fed = [p + r.token_ids[:-1] for p, r in zip(prompts, results, strict=True)]
            assert [r.activations for r in results] == run.activations
        else:
            for p in prompts:
                assert "".join(llm.stream(p, max_new_tokens=6)) is not None
            fed = list(prompts)  # (compared over the prompt's positions)
    assert len(run.activations) == 2
    for ids, kept in zip(fed, run.activations, strict=True):
        _, cache = llm.run_with_cache([ids], names)
        for name in names:
            whole = cache[name][0]
            assert kept[name].shape[1:] == whole.shape[1:] and kept[name].shape[0] >= len(ids)
            err = (kept[name][: len(ids)] - whole).abs().max().item()
            print(f"{how} {name}: kept {tuple(kept[name].shape)}, max |kept - whole| = {err:.2e}")
            assert err < 1e-4
            if how == "generate":
                assert kept[name].shape[0] == len(ids)


def test_kept_activations_are_bounded(llm: infer.LLM) -> None:
    """A request whose kept points would pass ``cache_bytes`` fails at its first forward, naming
    the bound; a bad bound is refused at once."""
    with llm.hooks(cache=True, cache_bytes=4096), pytest.raises(ValueError, match="cache_bytes is"):
        llm.generate(list(range(3, 12)), max_new_tokens=6)
    with llm.hooks(cache=True, cache_bytes=4096):
        handle = llm.engine.submit_many([list(range(3, 12))], [SamplingParams(max_tokens=6)], drive=True)[0]
        _tokens(handle)
    assert handle.finish_detail == "error" and "cache_bytes is" in str(handle.exception)
    print(f"\n{handle.exception}")
    with pytest.raises(ValueError, match="cache_bytes must be"):
        llm.hooks(cache=True, cache_bytes=0).__enter__()


def test_hooked_rows_are_never_reused(llm: infer.LLM) -> None:
    """A prompt run under an editing hook takes no K/V the engine holds, and leaves none: the same
    prompt afterwards reuses nothing and gives the unhooked tokens."""
    prompt = list(range(80, 130))
    params = [SamplingParams(max_tokens=6, ignore_eos=True)]
    plain = _recomputed(llm, prompt, 6, [])
    held = llm.engine.submit_many([prompt[:40]], params, drive=True)[0]  # a row holding its start
    _tokens(held)
    with llm.hooks(fwd_hooks=[(POINT, _steer)]):
        hooked = llm.engine.submit_many([prompt], params, drive=True)[0]
        steered = _tokens(hooked)
    after = llm.engine.submit_many([[*prompt, 7]], params, drive=True)[0]
    after_tokens = _tokens(after)
    print(f"\ncached: hooked {hooked.cached}, after {after.cached} (the first request's 40 at most)")
    assert hooked.cached == 0 and after.cached <= 40
    assert steered == _recomputed(llm, prompt, 6, [(POINT, _steer)]) != plain
    assert after_tokens == _recomputed(llm, [*prompt, 7], 6, [])
