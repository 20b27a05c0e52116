"""The public API refuses bad arguments up front, and stops on non-finite logits.

Every call here fails before any model work with a `TypeError` (wrong type) or a
`ValueError` (value out of range) whose message names the argument; non-finite
logits raise `NonFiniteLogitsError` naming the step and the batch row instead of
emitting token 0 forever. The end-to-end sampling test draws the first token of many
identical prompts through `generate` and compares the frequencies with the
distribution computed here from the model's own logits.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

import infer
from infer.llm import SamplingOptions
from infer.params import NonFiniteLogitsError, SamplingParams
from infer.testing import reference_sampling_probs


@pytest.fixture(scope="module")
def llm(tiny_ckpt_factory: Callable[..., Path]) -> infer.LLM:
    return infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32)


# ---- max_new_tokens ------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -3])
def test_max_new_tokens_below_one_is_refused_everywhere(llm: infer.LLM, value: int) -> None:
    """0 used to raise IndexError for one prompt and return [] for a batch; now one rule."""
    messages = [{"role": "user", "content": "Hi"}]
    calls: list[Callable[[], Any]] = [
        lambda: llm.generate("Hello", max_new_tokens=value),
        lambda: llm.generate(["Hello", "Hi"], max_new_tokens=value),
        lambda: llm.stream("Hello", max_new_tokens=value),
        lambda: llm.chat(messages, max_new_tokens=value),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            call()


@pytest.mark.parametrize("value", [1.5, 2.0, "8", None, True])
def test_max_new_tokens_must_be_an_int(llm: infer.LLM, value: Any) -> None:
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        llm.generate("Hello", max_new_tokens=value)


def test_max_new_tokens_one_generates_one(llm: infer.LLM) -> None:
    assert len(llm.generate("Hello", max_new_tokens=1).token_ids) == 1
    one: Any = np.int64(1)  # numpy ints are ints
    assert [len(r.token_ids) for r in llm.generate(["Hello", "Hi"], max_new_tokens=one)] == [1, 1]


# ---- sampling arguments through the API ------------------------------------------------

BAD_SAMPLING = [
    ({"temperature": math.nan}, ValueError, "temperature must be finite"),
    ({"temperature": -1.0}, ValueError, "temperature must be >= 0"),
    ({"top_k": 1.5}, TypeError, "top_k must be an int"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_p": math.inf}, ValueError, "top_p must be finite"),
    ({"seed": 2**70}, ValueError, "seed must be an int in"),
    ({"stop": ""}, ValueError, "stop strings must be non-empty"),
    ({"stop": ["ok", ""]}, ValueError, "stop strings must be non-empty"),
    ({"stop": ["ok", 3]}, TypeError, "stop must be a string or a list of strings"),
    ({"stop": 3}, TypeError, "stop must be a string or a list of strings"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_SAMPLING)
def test_generation_arguments_refused_up_front(
    llm: infer.LLM, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    kw = {"temperature": 0.7, **kwargs}
    with pytest.raises(error, match=match):
        llm.generate("Hello", max_new_tokens=4, **kw)
    with pytest.raises(error, match=match):
        llm.stream("Hello", max_new_tokens=4, **kw)  # refused on the call, not on the first next()
    with pytest.raises(error, match=match):
        llm.chat(messages, max_new_tokens=4, **kw)


def test_unknown_keywords_are_refused_by_name(llm: infer.LLM) -> None:
    """The sampling keywords are declared once (`infer.api.SamplingOptions`); any other is a TypeError."""
    messages = [{"role": "user", "content": "Hi"}]
    typo: dict[str, Any] = {"temprature": 0.5}
    with pytest.raises(TypeError, match=r"generate\(\) got an unexpected keyword argument 'temprature'"):
        llm.generate("Hello", max_new_tokens=4, **typo)
    with pytest.raises(TypeError, match=r"stream\(\) got an unexpected keyword argument 'temprature'"):
        llm.stream("Hello", max_new_tokens=4, **typo)
    with pytest.raises(TypeError, match=r"chat\(\) got an unexpected keyword argument 'temprature'"):
        llm.chat(messages, max_new_tokens=4, **typo)


def test_sampling_keywords_are_sampling_params_fields() -> None:
    """`SamplingOptions` adds only the three constraints to `SamplingParams`' fields: a request's
    values are defined, defaulted and checked there alone."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    extra = set(SamplingOptions.__annotations__) - fields
    print(f"keywords that are not SamplingParams fields: {sorted(extra)}")
    assert extra == {"json_schema", "regex", "grammar"}


# ---- prompts ---------------------------------------------------------------------------

BAD_PROMPTS = [
    ("", ValueError, r"prompt is empty \(an empty string\)"),
    ([], ValueError, r"prompt is empty \(an empty list of token ids\)"),
    ([[]], ValueError, r"prompt 0 is empty \(an empty list of token ids\)"),
    (["Hi", ""], ValueError, r"prompt 1 is empty \(an empty string\)"),
    ([1, 2.5], TypeError, "token ids must be ints, found 2.5"),
    ([1, True], TypeError, "token ids must be ints"),
    ([1, 10**6], ValueError, r"token id 1000000 is out of range \[0, 272\)"),
    ([-1], ValueError, "token id -1 is out of range"),
    ([[1], [2, 3.0]], TypeError, "prompt 1: token ids must be ints"),
    (["Hi", [1, 2], 3], TypeError, "a batch of prompts must hold only strings or lists of token ids"),
    ([[[1]]], TypeError, "prompt 0: token ids must be ints"),
    (None, TypeError, "prompt must be a string or a list of token ids, got NoneType"),
    ({"text": "Hi"}, TypeError, "got dict"),
    (b"Hi", TypeError, "got bytes"),
]


@pytest.mark.parametrize(("prompt", "error", "match"), BAD_PROMPTS)
def test_bad_prompts_are_refused(llm: infer.LLM, prompt: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        llm.generate(prompt, max_new_tokens=2)


def test_stream_takes_one_prompt(llm: infer.LLM) -> None:
    with pytest.raises(TypeError, match="stream\\(\\) takes one prompt"):
        llm.stream(cast(Any, ["Hello", "Hi"]), max_new_tokens=2)


def test_mixed_batch_of_text_and_ids(llm: infer.LLM) -> None:
    ids = llm.tokenizer.encode("Hello")
    mixed = llm.generate(cast(Any, ["Hello", ids, tuple(ids)]), max_new_tokens=5)
    assert [r.token_ids for r in mixed] == [llm.generate(ids, max_new_tokens=5).token_ids] * 3


# ---- dtype -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.float64, "int8", "float8"])
def test_non_float_dtypes_are_refused(tiny_ckpt_factory: Callable[..., Path], dtype: Any) -> None:
    with pytest.raises(
        ValueError, match=r"unsupported dtype .*models compute in float32, float16 or bfloat16"
    ):
        infer.load(tiny_ckpt_factory("llama"), dtype=dtype)


@pytest.mark.parametrize(
    ("value", "error"),
    [("yes", ValueError), ("AUTO", ValueError), (1, TypeError), (2.0, TypeError), ([], TypeError)],
)
def test_bad_compile_values_are_refused(
    tiny_ckpt_factory: Callable[..., Path], value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="compile must be True, False, 'auto' or None"):
        infer.load(tiny_ckpt_factory("llama"), compile=value)


STREAMED = infer.StreamingConfig(memory_budget="1GB")
STREAMED_EMBEDDINGS = infer.StreamingConfig(
    memory_budget="1GB", max_resident_layers=0, resident_embeddings=False
)
EMBEDDINGS = "StreamingConfig(resident_embeddings=False) cannot combine with"
HEADLESS = infer.StreamingConfig(memory_budget="1GB", head=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"compile": True, "streaming": STREAMED},
            "compile=True cannot combine with streaming: compile=True applies",
        ),
        ({"compile": True, "tensor_parallel": 2}, "compile=True cannot combine with tensor_parallel=2"),
        ({"compile": True, "pipeline_parallel": 2}, "compile=True cannot combine with pipeline_parallel=2"),
        (
            {"quantize": "int8", "streaming": STREAMED_EMBEDDINGS},
            f"{EMBEDDINGS} quantize='int8': a quantized head",
        ),
        (
            {"tensor_parallel": 2, "streaming": STREAMED_EMBEDDINGS},
            f"{EMBEDDINGS} tensor_parallel=2: a rank keeps",
        ),
        ({"pipeline_parallel": 2, "streaming": STREAMED_EMBEDDINGS}, f"{EMBEDDINGS} pipeline_parallel=2"),
        (
            {"tensor_parallel": 2, "streaming": HEADLESS},
            "StreamingConfig(head=False) cannot combine with tensor_parallel=2: a model without its head",
        ),
        (
            {"pipeline_parallel": 2, "streaming": HEADLESS},
            "StreamingConfig(head=False) cannot combine with pipeline_parallel=2",
        ),
    ],
    ids=[
        "compile-streaming",
        "compile-tp",
        "compile-pp",
        "embeddings-quantize",
        "embeddings-tp",
        "embeddings-pp",
        "headless-tp",
        "headless-pp",
    ],
)
def test_options_that_cannot_combine_are_refused_naming_both(
    tiny_ckpt_factory: Callable[..., Path], kwargs: dict[str, Any], message: str
) -> None:
    """Before anything is read, or any process group made (`infer.combinations.REFUSED`)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        infer.load(tiny_ckpt_factory("llama"), **kwargs)


def test_quantize_is_refused_for_a_gguf_file(tmp_path: Path) -> None:
    from infer.gguf.writer import write_gguf
    from infer.testing import build_tokenizer, tiny_hf_model

    path = write_gguf(tmp_path / "llama.gguf", tiny_hf_model("llama"), build_tokenizer(tmp_path / "tok"))
    with pytest.raises(
        ValueError, match=re.escape(f"quantize='q4_0' cannot combine with a GGUF file ({path})")
    ):
        infer.load(path, quantize="q4_0")


def test_dtype_of_the_wrong_type_is_refused(tiny_ckpt_factory: Callable[..., Path]) -> None:
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype or a string"):
        infer.load(tiny_ckpt_factory("llama"), dtype=32)  # type: ignore[arg-type]


BAD_LOAD_TYPES = [
    ({"validate": "no"}, r"validate must be a bool \(True or False\), got 'no' \(str\)"),
    ({"validate": None}, r"validate must be a bool \(True or False\), got None \(NoneType\)"),
    ({"cache": "no"}, r"cache must be a bool \(True or False\), got 'no' \(str\)"),
    ({"cache": 0}, r"cache must be a bool \(True or False\), got 0 \(int\)"),
    ({"deterministic": 1}, r"deterministic must be a bool \(True or False\), got 1 \(int\)"),
    ({"tensor_parallel": 1.0}, r"tensor_parallel must be an int, got 1.0 \(float\)"),
    ({"tensor_parallel": True}, r"tensor_parallel must be an int, got True \(bool\)"),
    ({"pipeline_parallel": "1"}, r"pipeline_parallel must be an int, got '1' \(str\)"),
    ({"lookup": 0.0}, r"lookup must be an int, got 0.0 \(float\)"),
    ({"lookup": False}, r"lookup must be an int, got False \(bool\)"),
    ({"lookup": 2, "speculative_tokens": 4.0}, r"speculative_tokens must be an int, got 4.0 \(float\)"),
    ({"progress": 3}, r"progress must be a callable \(done, total\) or None, got 3"),
    (
        {"streaming": {"memory_budget": "1GB"}},
        r"streaming must be an infer.StreamingConfig or None, got dict",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_LOAD_TYPES, ids=lambda v: str(v)[:40])
def test_load_keywords_of_the_wrong_type_are_refused(
    tiny_ckpt_factory: Callable[..., Path], kwargs: dict[str, Any], message: str
) -> None:
    """Bool options take bools only, int options ints only (not bools): ``validate="no"`` used to
    turn validation on and ``tensor_parallel=1.0`` to load; now each names itself, up front."""
    with pytest.raises(TypeError, match=message):
        infer.load(tiny_ckpt_factory("llama"), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel": 0}, "tensor_parallel must be an int >= 1, got 0"),
        ({"pipeline_parallel": -1}, "pipeline_parallel must be an int >= 1, got -1"),
        ({"lookup": 17}, r"lookup must be an int in \[0, 16\], got 17"),
        ({"lookup": -1}, r"lookup must be an int in \[0, 16\], got -1"),
    ],
)
def test_load_ints_out_of_range_are_refused_up_front(
    tiny_ckpt_factory: Callable[..., Path], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        infer.load(tiny_ckpt_factory("llama"), **kwargs)


def test_load_takes_numpy_ints_and_plain_bools(tiny_ckpt_factory: Callable[..., Path]) -> None:
    one: Any = np.int64(1)
    llm = infer.load(tiny_ckpt_factory("llama"), tensor_parallel=one, validate=False, cache=False, lookup=0)
    assert llm.parallel is None


# ---- non-finite logits ---------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_weights_stop_at_prefill(tiny_ckpt_factory: Callable[..., Path], temperature: float) -> None:
    """A NaN weight made the model emit token 0 forever (greedy) or fail inside torch.multinomial."""
    llm = infer.load(tiny_ckpt_factory("qwen3"))
    with torch.no_grad():
        cast(torch.Tensor, llm.model.norm.weight)[3] = math.nan
    with pytest.raises(
        NonFiniteLogitsError, match=r"non-finite logits \(NaN or inf\) at prefill .*batch row 0"
    ):
        llm.generate("Hello", max_new_tokens=8, temperature=temperature, seed=0)


@pytest.mark.parametrize(("bad", "temperature"), [(math.nan, 0.0), (math.inf, 0.9), (-math.inf, 0.0)])
def test_non_finite_logits_name_the_decode_step_and_row(
    tiny_ckpt_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, bad: float, temperature: float
) -> None:
    llm = infer.load(tiny_ckpt_factory("gemma3"))
    head = llm.model.head
    calls = []

    def spoiled_head(h: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        logits = head(h, greedy=greedy)
        calls.append(1)
        if len(calls) == 3:  # prefill, decode step 1, decode step 2 <- here
            logits = logits.clone()
            if bad == -math.inf:
                logits[1] = bad  # every logit -inf: nothing can be sampled
            else:
                logits[1, ..., 7] = bad
        return logits

    monkeypatch.setattr(llm.model, "head", spoiled_head)
    with pytest.raises(NonFiniteLogitsError, match="at decode step 2 \\(generated token 3\\), batch row 1"):
        llm.generate(["Hello", "A longer prompt"], max_new_tokens=6, temperature=temperature, seed=1)


def test_finite_logits_pass_unchanged(llm: infer.LLM) -> None:
    a = llm.generate("Hello", max_new_tokens=12, temperature=0.9, top_k=20, seed=5)
    b = llm.generate("Hello", max_new_tokens=12, temperature=0.9, top_k=20, seed=5)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12


# ---- sampling through generate --------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.6, 0, 1.0), (1.7, 12, 1.0), (3.0, 0, 0.8)])
def test_generate_samples_the_first_token_from_the_right_distribution(
    tiny_ckpt_factory: Callable[..., Path], temperature: float, top_k: int, top_p: float
) -> None:
    """N identical prompts in one batch: the first tokens are N draws from softmax(logits / T), filtered."""
    llm = infer.load(tiny_ckpt_factory("qwen3"))
    ids = llm.tokenizer.encode("The tiny model")
    with torch.no_grad():
        logits = llm.model(torch.tensor([ids]))[0, -1].double().tolist()
    expected = reference_sampling_probs(logits, temperature, top_k, top_p)
    n = 4000
    results = llm.generate(
        [ids] * n, max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=3
    )
    observed = np.bincount([r.token_ids[0] for r in results], minlength=len(expected)) / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    kept = expected > 0
    z = (np.abs(observed - expected)[kept] / sigma[kept]).max()
    print(
        f"\nT={temperature} top_k={top_k} top_p={top_p}: {kept.sum()} tokens possible, "
        f"max |observed - expected| {np.abs(observed - expected).max():.3f} = {z:.2f} sigma over {n} draws"
    )
    assert np.all(observed[~kept] == 0.0)
    assert z <= 5.0


# ---- start_engine ----------------------------------------------------------------------------


def test_start_engine_refuses_unknown_keywords_alike(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Before and after the engine exists: one TypeError naming the keyword (after, it used to be an
    AttributeError from reading the engine's attribute of that name)."""
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32, compile=False)
    message = (
        r"start_engine\(\) got an unexpected keyword argument 'foo'; the engine's settings are "
        r"max_batch, max_waiting, context, prefill_chunk, idle_prefill_chunk"
    )
    try:
        with pytest.raises(TypeError, match=message):
            llm.start_engine(foo=1)
        assert llm._engine is None  # nothing was made
        engine = llm.start_engine(max_batch=2)
        with pytest.raises(TypeError, match=message):
            llm.start_engine(foo=1)
        with pytest.raises(TypeError, match="unexpected keyword argument 'runner'"):
            llm.start_engine(runner=None)
        with pytest.raises(ValueError, match="already runs with max_batch=2, not 3"):
            llm.start_engine(max_batch=3)
        assert llm.start_engine(max_batch=2) is engine
    finally:
        if llm._engine is not None:
            llm._engine.close()


def test_start_engine_compares_what_was_asked_not_what_was_derived(
    tiny_ckpt_factory: Callable[..., Path],
) -> None:
    """``context=None`` is made into the model's positions: asking for it again (or making the
    engine with it) is the same setting, not a conflict; a default asked explicitly is too."""
    llm = infer.load(tiny_ckpt_factory("llama"), dtype=torch.float32, compile=False)
    try:
        engine = llm.start_engine(context=None)
        assert engine.context == llm.config.max_position_embeddings
        assert llm.start_engine(context=None) is engine
        assert llm.start_engine(max_waiting=64) is engine  # the default it was made with
        with pytest.raises(ValueError, match="already runs with context=None, not 64"):
            llm.start_engine(context=64)
    finally:
        if llm._engine is not None:
            llm._engine.close()
