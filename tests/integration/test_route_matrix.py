"""Every option alone and in pairs, on a safetensors and a GGUF model: each generates, or is refused by name.

The options: streaming, lookup, a draft (``draft="self"``), quantize (int8), ``compile=False`` /
``True``, deterministic, an intervention (a vector added to block 0's output), a JSON schema, a
stop string, a batch of two prompts; tensor- and pipeline-parallel over two processes
(``tp2`` / ``pp2``, each with every other option, in one launch each). The models: the tiny
Llama as safetensors (float32) and as a Q4_0 GGUF file (its default: packed products).

What each must give, greedy, 8 tokens:

* the speed-only options (streaming, lookup, a draft, compile, a batch, tp2 / pp2) give the
  tokens of the same run without them: **equal** in the deterministic mode; in the default mode,
  where a product may sum in another order (a kernel picked by the row count, tensor
  parallelism's partial sums), a token may differ only where the plain run's logits of the two
  tokens are within rounding of each other (`Plain.first_difference` measures and prints it);
* quantize, an intervention, a JSON schema and a stop string change the answer by design: the
  reference is the same options run plainly (eager, one process, one prompt at a time);
* a pair `infer.combinations.REFUSED` lists is refused by its `ValueError`, which names both
  options (`refusal` below: this test's own list of what must be refused);
* with lookup or a draft, verify passes run (the planner is made to propose every pass it can),
  except where speculation gives way (a JSON schema: `infer.combinations.GIVES_WAY`).

Nothing else passes: no internal exception, no silently different answer. The prompts stay
short: under 16 tokens, one compiled prefill bucket within the packed int8 kernel's 16-row bound
(a compiled prefill past it fails today: `QuantizedLinear._tile_dtype` inside the graph), and far
under the 64 tokens past which a follower rank fails at a rejected proposal (both being fixed).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_env import free_port, rank_env

import infer
from infer.gguf.writer import write_gguf
from infer.speculative import Speculator
from infer.testing import build_checkpoint, build_tokenizer, tiny_hf_model

OPTIONS = ("streaming", "lookup", "draft", "quantize", "compile=False", "compile=True", "deterministic",
           "intervention", "json", "stop", "batch")  # fmt: skip
LOAD = frozenset(
    {"streaming", "lookup", "draft", "quantize", "compile=False", "compile=True", "deterministic"}
)
SEMANTIC = frozenset({"quantize", "intervention", "json", "stop"})  # change the answer by design
FORMATS = ("safetensors", "gguf")
PROMPTS = ("abcabcabcab", "Twelve chars")  # the first repeats itself: lookup finds proposals in it
NEW_TOKENS = 8
# Default mode: a token may differ from the plain run's where its logit and the plain token's are this
# close (relative to the largest logit), by the products' dtype. Measured on this tiny Llama, the
# logits of tensor parallelism (partial sums added in another order) against one process's, of the
# largest: float32 6.6e-7; bfloat16 products 1.3e-2 (dtype=bfloat16), 7.7e-3 (q4_0), 2.1e-2 (int8).
TIE = {"float32": 1e-5, "bfloat16": 5e-2}


def combos(extra: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every option alone and every pair (with ``extra`` added to each: a parallel mode)."""
    pairs = [p for p in itertools.combinations(OPTIONS, 2) if set(p) != {"compile=False", "compile=True"}]
    return [extra + c for c in [(), *[(o,) for o in OPTIONS], *pairs]]


def refusal(fmt: str, combo: tuple[str, ...]) -> str | None:
    """What the error must say when ``combo`` cannot run (None: it must run)."""
    given = set(combo)
    parallel = "tensor_parallel=2" if "tp2" in given else "pipeline_parallel=2" if "pp2" in given else None
    if "compile=True" in given and "streaming" in given:
        return "compile=True cannot combine with streaming"
    if "compile=True" in given and parallel:
        return f"compile=True cannot combine with {parallel}"
    if "quantize" in given and "tp2" in given:  # int8's per-row scales span the split rows
        return "quantize='int8' cannot combine with tensor_parallel=2"
    if "quantize" in given and fmt == "gguf":
        return "quantize='int8' cannot combine with a GGUF file"
    if "intervention" in given and parallel:
        return f"an intervention cannot combine with {parallel}"
    return None


# ---- running a combination (here and in each rank of `CHILD`) ----------------------------------


def load_options(fmt: str, options: frozenset[str], parallel: bool = False) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": torch.float32 if fmt == "safetensors" else None}
    if "streaming" in options:
        # A float embedding and head stream too; a packed or quantized one, or a rank's, stays resident.
        packed = fmt == "gguf" or "quantize" in options or parallel
        kwargs["streaming"] = infer.StreamingConfig(
            memory_budget="256MB", max_resident_layers=0, layer_group_size=2, max_batch_size=2,
            max_context=64, resident_embeddings=None if packed else False,
        )  # fmt: skip
    if "lookup" in options:
        kwargs["lookup"] = 3
    if "draft" in options:
        kwargs["draft"] = "self"
    if "quantize" in options:
        kwargs["quantize"] = "int8"
    if "compile=False" in options:
        kwargs["compile"] = False
    if "compile=True" in options:
        kwargs["compile"] = True
    if "deterministic" in options:
        kwargs["deterministic"] = True
    return kwargs


def propose_all(
    self: Speculator, rows: int, proposals: dict[int, Any], drafting: dict[int, Any], span: int | None = None
) -> int:
    """`Speculator.plan` that runs every pass it can (within the forward's bound), so that verify
    passes run on models too tiny for one to pay."""
    longest = max(
        [len(p.tokens) for p in proposals.values()] + [room for room, _ in drafting.values()], default=0
    )
    if self.per_forward is not None:
        longest = min(longest, self.per_forward // (span or rows) - 1)
    return 1 + max(0, longest)


def intervention(llm: infer.LLM) -> contextlib.AbstractContextManager[Any]:
    vector = torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    return llm.intervene(layer=0, add=vector)


def generate(llm: infer.LLM, options: frozenset[str], stop: str, prompts: tuple[str, ...]) -> dict[str, Any]:
    """The tokens and texts of ``prompts`` under the call options in ``options``, and the verify
    passes it ran."""
    sampling: dict[str, Any] = {}
    if "json" in options:
        sampling["json_schema"] = {"type": "object"}
    if "stop" in options:
        sampling["stop"] = [stop]
    before = llm.engine.stats().get("spec_passes", 0) if llm.primary else 0
    with intervention(llm) if "intervention" in options else contextlib.nullcontext():
        results = llm.generate(list(prompts), max_new_tokens=NEW_TOKENS, **sampling)
    passes = llm.engine.stats().get("spec_passes", 0) - before if llm.primary else 0
    return {"tokens": [r.token_ids for r in results], "texts": [r.text for r in results], "passes": passes}


def run(
    models: dict[Any, Any],
    paths: dict[str, str],
    fmt: str,
    combo: tuple[str, ...],
    stop: str,
    **parallel: int,
) -> dict[str, Any]:
    """``combo`` on ``fmt``'s model (loaded once per load options, in ``models``): `generate`'s
    result, or the error it raised as ``{"error": [type, message]}``."""
    options = frozenset(combo)
    key = (fmt, options & LOAD)
    try:
        if key not in models:
            try:
                kwargs = {**load_options(fmt, options & LOAD, parallel=bool(parallel)), **parallel}
                models[key] = infer.load(paths[fmt], **kwargs)
            except Exception as e:
                models[key] = e
        llm = models[key]
        if isinstance(llm, Exception):
            raise llm
        return generate(llm, options, stop, PROMPTS if "batch" in options else PROMPTS[:1])
    except Exception as e:
        return {"error": [type(e).__name__, str(e)]}


# ---- the reference and the comparison ----------------------------------------------------------


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("routes")
    gguf = write_gguf(
        root / "llama-q4_0.gguf", tiny_hf_model("llama"), build_tokenizer(root / "tok"), qtype="Q4_0"
    )
    return {"safetensors": str(build_checkpoint(root / "llama", "llama")), "gguf": str(gguf)}


@pytest.fixture(scope="module")
def spec_plan() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Speculator, "plan", propose_all)
        yield


class Plain:
    """The reference runs: each semantic option set (and mode) plainly, one prompt at a time."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths
        self.models: dict[Any, infer.LLM] = {}
        self.runs: dict[Any, dict[str, Any]] = {}
        self.stops: dict[str, str] = {}

    def model(self, fmt: str, options: frozenset[str]) -> infer.LLM:
        key = (fmt, options)
        if key not in self.models:
            kwargs = load_options(fmt, options & {"quantize", "deterministic"} | {"compile=False"})
            self.models[key] = infer.load(self.paths[fmt], **kwargs)
        return self.models[key]

    def stop(self, fmt: str) -> str:
        """A stop string the plain run meets: a character from the middle of its text."""
        if fmt not in self.stops:
            text = self.run(fmt, frozenset(), 0)["texts"][0]
            chars = [c for c in text[2:] if c.isprintable() and not c.isspace()]
            self.stops[fmt] = chars[len(chars) // 2] if chars else "a"
        return self.stops[fmt]

    def run(self, fmt: str, options: frozenset[str], prompt: int) -> dict[str, Any]:
        """The plain run of ``options``' semantic options and mode on prompt ``prompt``."""
        plain = options & (SEMANTIC | {"deterministic"})
        key = (fmt, plain, prompt)
        if key not in self.runs:
            stop = self.stop(fmt) if "stop" in plain else ""
            self.runs[key] = generate(self.model(fmt, plain), plain, stop, PROMPTS[prompt : prompt + 1])
        return self.runs[key]

    def repeats(self, fmt: str, result: dict[str, Any]) -> bool:
        """Whether a token of ``result`` (but its last two) is one of the prompt's or generated before
        it: lookup then finds a proposal, and a pass runs."""
        llm = self.model(fmt, frozenset())
        for prompt, tokens in zip(PROMPTS, result["tokens"], strict=False):
            seen = llm.encode(prompt)
            for t in tokens[:-2]:
                if t in seen:
                    return True
                seen.append(t)
        return False

    def first_difference(self, fmt: str, options: frozenset[str], prompt: int, got: list[int]) -> str | None:
        """None when ``got`` is the plain run's tokens, or differs first where the plain run's logits
        of its token and ``got``'s are within `TIE` (outside the deterministic mode); else what differs."""
        want = self.run(fmt, options, prompt)["tokens"][0]
        if got == want:
            return None
        at = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        if "deterministic" in options or at == min(len(got), len(want)):
            return f"tokens {got}, plain {want}"
        llm = self.model(fmt, options & (SEMANTIC | {"deterministic"}))
        ids = llm.encode(PROMPTS[prompt]) + want[:at]
        with (
            torch.inference_mode(),
            intervention(llm) if "intervention" in options else contextlib.nullcontext(),
        ):
            logits = llm.model(torch.tensor([ids]))[0, -1].float()
        gap = abs(logits[want[at]] - logits[got[at]]).item() / logits.abs().max().item()
        print(f"{fmt} {sorted(options)} prompt {prompt}: token {at} differs, {got[at]} for {want[at]}: "
              f"their logits {gap:.1e} apart (of the largest)")  # fmt: skip
        products = "bfloat16" if fmt == "gguf" or "quantize" in options else "float32"
        return None if gap <= TIE[products] else f"tokens {got}, plain {want} ({gap:.1e} apart at {at})"


@pytest.fixture(scope="module")
def plain(paths: dict[str, str], spec_plan: None) -> Plain:
    return Plain(paths)


def check(plain: Plain, fmt: str, combo: tuple[str, ...], result: dict[str, Any], label: str) -> None:
    """``result`` (of `run`) is what ``combo`` must give (see the module's docstring)."""
    options = frozenset(combo)
    expected = refusal(fmt, combo)
    if expected is not None:
        assert "error" in result, f"{label}: ran, but must be refused ({expected})"
        kind, message = result["error"]
        assert kind == "ValueError" and expected in message, f"{label}: {kind}: {message}"
        return
    assert "error" not in result, f"{label}: {result['error'][0]}: {result['error'][1]}"
    for i, (tokens, text) in enumerate(zip(result["tokens"], result["texts"], strict=True)):
        difference = plain.first_difference(fmt, options, i, tokens)
        assert difference is None, f"{label} prompt {i}: {difference}"
        if tokens == plain.run(fmt, options, i)["tokens"][0]:
            assert text == plain.run(fmt, options, i)["texts"][0], f"{label} prompt {i}"
    if "json" not in options and ("draft" in options or ("lookup" in options and plain.repeats(fmt, result))):
        assert result["passes"] > 0, f"{label}: no verify pass ran"


def _case(fmt: str, combo: tuple[str, ...]) -> Any:
    marks = [pytest.mark.slow] if "compile=True" in combo else []
    return pytest.param(fmt, combo, marks=marks, id=f"{fmt}-{'+'.join(combo) or 'plain'}")


_models: dict[Any, Any] = {}  # this process's loaded models, by format and load options


@pytest.mark.parametrize(("fmt", "combo"), [_case(f, c) for f in FORMATS for c in combos()])
def test_route(plain: Plain, paths: dict[str, str], fmt: str, combo: tuple[str, ...]) -> None:
    result = run(_models, paths, fmt, combo, plain.stop(fmt))
    print(f"{fmt} {combo}: {result}")
    check(plain, fmt, combo, result, f"{fmt} {'+'.join(combo) or 'plain'}")


# ---- tensor and pipeline parallelism: one launch of two ranks each -----------------------------

CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
args = json.loads(sys.argv[1])
sys.path[:0] = args["tests"]
import test_route_matrix as m
m.Speculator.plan = m.propose_all
models, out = {}, []
for fmt, combo in args["cases"]:
    out.append(m.run(models, args["paths"], fmt, tuple(combo), args["stops"][fmt], **args["parallel"]))
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp2", "pp2"])
def test_parallel_routes(plain: Plain, paths: dict[str, str], mode: str) -> None:
    """``mode`` alone and with every option, on both models, in one launch of two ranks: every rank
    gives rank 0's result, which is what one process gives (or the same refusal)."""
    cases = [(fmt, c) for fmt in FORMATS for c in combos((mode,)) if len(c) <= 2]
    parallel = {"tensor_parallel": 2} if mode == "tp2" else {"pipeline_parallel": 2}
    here = Path(__file__).parent
    args = {"tests": [str(here), str(here.parent)], "paths": paths, "cases": cases, "parallel": parallel,
            "stops": {fmt: plain.stop(fmt) for fmt in FORMATS}}  # fmt: skip
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            env=rank_env(rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    ranks = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a rank did not finish within 300 s (a hang)")
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank exited with {proc.returncode} and no result:\n{stderr[-3000:]}"
        ranks.append(json.loads(lines[-1].removeprefix("RESULT ")))
    failed = []
    for (fmt, combo), first, second in zip(cases, *ranks, strict=True):
        label = f"{fmt} {'+'.join(combo)}"
        print(f"{label}: {first}")
        try:
            check(plain, fmt, tuple(combo), first, label)
            first.pop("passes", None), second.pop("passes", None)
            assert second == first, f"{label}: rank 1 gave {second}"
        except AssertionError as e:
            failed.append(str(e).splitlines()[0])
    assert not failed, "\n".join(failed)
