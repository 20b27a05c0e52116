"""`infer.lens.save_activations`: shards read back equal to `run_with_cache`, memory bounded by the
shard size, an interrupted run resumed to the same files' contents, and bad arguments refused."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import infer
import infer.lens as lens
from infer.lens.save import Activations, load_shard

NAMES = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.hook_resid_post"]


@pytest.fixture
def llm(tiny_ckpt_factory: Callable[..., Path]) -> infer.LLM:
    return infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)


def _inputs() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = [7, 7, 7, 12, 3, 3, 9]  # batches of 2: (7, 7), (7, 12) padded, (3, 3), (9)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]


def _saved_alike(
    want: infer.LLM, got: infer.LLM, inputs: list[list[int]], names: list[str], out: Path, what: object
) -> Activations:
    """Both models' `save_activations` of ``inputs`` at ``names``, every value bitwise equal; the
    first model's, read back."""
    want.save_activations(inputs, names, out / "want", batch_size=2, progress=False)
    got.save_activations(inputs, names, out / "got", batch_size=2, progress=False)
    a, b = Activations(out / "want"), Activations(out / "got")
    for i in range(len(inputs)):
        for n in names:
            assert torch.equal(a.sequence(i)[n], b.sequence(i)[n]), (what, i, n)
    return a


def test_saved_activations_equal_run_with_cache(llm: infer.LLM, tmp_path: Path) -> None:
    inputs = _inputs()
    index = llm.save_activations(inputs, NAMES, tmp_path, batch_size=2, shard_bytes=4096, progress=False)
    saved = Activations(tmp_path)
    assert len(saved) == len(inputs) and len(saved.shards) > 1  # small shards: several files
    assert json.loads(index.read_text())["complete"]
    worst = 0.0
    for i, ids in enumerate(inputs):
        _, want = llm.run_with_cache([ids], NAMES)
        got = saved.sequence(i)
        for n in NAMES:
            assert got[n].shape == want[n][0].shape, n
            worst = max(worst, (got[n] - want[n][0]).abs().max().item())
    print(f"\nlargest |saved - run_with_cache|: {worst:.2e} over {len(inputs)} sequences")
    assert worst <= 1e-5
    shard = load_shard(saved.shards[0])
    assert shard["sequence"].dtype == torch.int64 and shard["position"].tolist()[:7] == list(range(7))


def test_an_interrupted_run_resumes(llm: infer.LLM, tmp_path: Path) -> None:
    inputs = _inputs()
    whole = tmp_path / "whole"
    llm.save_activations(inputs, NAMES, whole, batch_size=1, shard_bytes=1, progress=False)

    def interrupted() -> Iterator[list[int]]:
        yield from inputs[:4]
        raise KeyboardInterrupt

    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        llm.save_activations(interrupted(), NAMES, part, batch_size=1, shard_bytes=1, progress=False)
    assert len(Activations(part)) == 4  # every finished shard is on disk, the index says so
    llm.save_activations(inputs, NAMES, part, batch_size=1, shard_bytes=1, progress=False)
    a, b = Activations(whole), Activations(part)
    assert len(a) == len(b) == len(inputs)
    for i in range(len(inputs)):
        for n in NAMES:
            assert torch.equal(a.sequence(i)[n], b.sequence(i)[n]), (i, n)


def test_bad_arguments_are_refused(llm: infer.LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"blocks\.0\.hook_resid_post"):
        llm.save_activations([[1, 2, 3]], ["blocks.0.hook_resid_psot"], tmp_path, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        llm.save_activations([[1, 2, 3]], NAMES, tmp_path, batch_size=0, progress=False)
    llm.save_activations([[1, 2, 3]], NAMES, tmp_path, progress=False)
    with pytest.raises(ValueError, match="another out_dir"):  # an index of other points is not mixed in
        llm.save_activations([[1, 2, 3]], NAMES[:1], tmp_path, progress=False)
    with pytest.raises(FileNotFoundError, match="index"):
        Activations(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"return_type: expected 'logits' or None, got 'loss'"):
        llm.run_with_cache([1, 2, 3], NAMES, return_type="loss")  # type: ignore[call-overload]
    assert lens.save_activations is not None


def test_a_streamed_model_saves_the_resident_models_activations(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Layer streaming under a budget gives the same activations, bitwise in the deterministic mode
    (the same products on the same shapes: docs/numerics.md)."""
    from infer.streaming import StreamingConfig

    path = tiny_ckpt_factory("llama")
    resident = infer.load(path, dtype=torch.float32, deterministic=True)
    streamed = infer.load(path, dtype=torch.float32, deterministic=True,
                          streaming=StreamingConfig(memory_budget="64MB"))  # fmt: skip
    _saved_alike(resident, streamed, _inputs()[:4], NAMES, tmp_path, "streamed")


def test_sequences_of_unequal_lengths_share_a_forward(
    tiny_ckpt_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consecutive sequences of different lengths run in one right-padded forward; in the
    deterministic mode each one's activations are bitwise those of the sequence run alone (a
    causal forward never reads the padding after a position, and every product computes each row
    on its own: docs/numerics.md)."""
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32, deterministic=True)
    g = torch.Generator().manual_seed(9)
    inputs = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 9, 7, 8)]
    forwards: list[tuple[int, ...]] = []
    real = lens.run_with_cache

    def counted(llm: infer.LLM, ids: torch.Tensor, *args: object, **kw: object) -> object:
        forwards.append(tuple(ids.shape))
        return real(llm, ids, *args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr("infer.lens.save.run_with_cache", counted)
    llm.save_activations(inputs, NAMES, tmp_path, batch_size=4, progress=False)
    monkeypatch.setattr("infer.lens.save.run_with_cache", real)
    assert forwards == [(4, 9)]
    saved = Activations(tmp_path)
    for i, ids in enumerate(inputs):
        _, alone = llm.run_with_cache([ids], NAMES)
        for n in NAMES:
            assert torch.equal(saved.sequence(i)[n], alone[n][0]), (i, n)


@pytest.fixture(scope="module")
def gguf_q4(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    from tiny_gguf import write_gguf_files

    overrides: dict[str, dict[str, object]] = {"llama": {}, "qwen3": {}}  # untied head, tied head
    return write_gguf_files(tmp_path_factory.mktemp("gguf-act"), overrides, ("Q4_0",))


@pytest.mark.parametrize("kind", ["llama Q4_0", "qwen3 Q4_0 (tied)", "llama float", "qwen3 float (tied)"])
def test_a_streamed_model_without_its_head_saves_the_same_activations(
    kind: str,
    gguf_q4: dict[tuple[str, str], Path],
    tiny_ckpt_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """``StreamingConfig(head=False)``: no head is placed, no logits are planned (a smaller plan than
    with the head), the activations are bitwise the resident model's (deterministic mode), and a
    forward that needs logits is refused by name before it runs."""
    from infer.streaming import StreamingConfig

    arch, fmt = kind.split()[:2]
    path = gguf_q4[arch, "Q4_0"] if fmt == "Q4_0" else tiny_ckpt_factory(arch)
    dtype = None if fmt == "Q4_0" else torch.float32
    resident = infer.load(path, dtype=dtype, deterministic=True)

    def streamed(head: bool) -> infer.LLM:
        config = StreamingConfig(
            memory_budget="64MB", max_resident_layers=0, max_context=32, max_prefill_tokens=32, head=head
        )
        return infer.load(path, dtype=dtype, deterministic=True, streaming=config)

    with_head, bare = streamed(True), streamed(False)
    plan, plan_with = bare.model.executor.plan, with_head.model.executor.plan  # type: ignore[attr-defined]
    print(f"\n{kind}: {plan.describe()}\n  with the head: {plan_with.total} bytes, without: {plan.total}")
    assert not plan.head and "none (activations only)" in plan.describe()
    assert plan.workspace_bytes < plan_with.workspace_bytes and plan.total < plan_with.total
    assert all(t.is_meta for t in bare.model.lm_head.state_dict().values())  # never read, never converted
    names = [n for n in lens.hook_names(bare) if n.endswith(("hook_embed", "hook_resid_post", "hook_z"))]
    inputs = _inputs()[:4]
    a = _saved_alike(resident, bare, inputs, names, tmp_path / "points", kind)
    layers = bare.model.config.num_hidden_layers
    _, cache = bare.run_with_cache([inputs[0]], names[-1], stop_at_layer=layers)
    assert torch.equal(cache[names[-1]][0], a.sequence(0)[names[-1]])
    forwards = bare.model.executor.stats.forwards
    with pytest.raises(ValueError, match=r"StreamingConfig\(head=False\)"):
        bare.run_with_cache([inputs[0]], names[-1])  # logits: refused before any block runs
    assert bare.model.executor.stats.forwards == forwards
    _saved_alike(resident, bare, inputs, ["ln_final.hook_normalized"], tmp_path / "final", kind)  # no head
    with pytest.raises(ValueError, match=r"StreamingConfig\(head=False\)"):
        bare.generate([1, 2, 3], max_new_tokens=2)
