"""The public API: `load` a checkpoint, get an `LLM`, generate text."""

from __future__ import annotations

import dataclasses
import operator
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack, overload

import torch

from infer.aot import PackageCache, Recipe
from infer.aot import pays as aot_pays
from infer.chat_template import check_unicode
from infer.generate import (
    NonFiniteLogitsError,
    RowState,
    SamplingParams,
    TextStream,
    check_max_new_tokens,
    cut_at_stop,
    generate_steps,
    row_seed,
    run_to_end,
)
from infer.loader.checkpoint import open_checkpoint
from infer.loader.checkpoint import resolve_checkpoint as resolve_checkpoint  # kept importable here
from infer.loader.checkpoint import resolve_dtype as resolve_dtype  # (the CLI imports it from here)
from infer.loader.config import ModelConfig
from infer.loader.tokenizer import Tokenizer
from infer.loading import build_model
from infer.models.base import DecoderLM
from infer.models.common import is_deterministic
from infer.perplexity import DEFAULT_CONTEXT, PerplexityOptions
from infer.step import Stepper
from infer.structured import Constraint, check_logit_bias, constraint_of
from infer.tools import ToolCall

if TYPE_CHECKING:
    from infer.distributed import Parallel
    from infer.engine import Engine, RequestHandle
    from infer.perplexity import PerplexityResult
    from infer.speculative import Speculative
    from infer.streaming import StreamingConfig

Prompt = str | list[int]
Message = dict[str, Any]
ProgressFn = Callable[[int, int], None]


@dataclass
class GenerationResult:
    """The generated part of one prompt.

    ``token_ids`` ends with the EOS id when generation stopped on one;
    ``text`` is the decoded generation without special tokens, cut before a stop string (with
    tool calls: the text around them). ``finish_reason`` is "eos", "stop" (a stop string, or a
    constraint that admits nothing more), "length", or "tool_calls" (`LLM.chat` with ``tools``:
    ``tool_calls`` holds them). ``parsed``: with a ``json_schema``, the finished JSON — an
    instance of the pydantic model when one was given, else the decoded value.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "stop", "length" or "tool_calls"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    tool_calls: list[ToolCall] = field(default_factory=list)
    parsed: Any = None

    def __str__(self) -> str:
        return self.text

    @property
    def message(self) -> dict[str, Any]:
        """The reply as a chat message (OpenAI's shape, with ``tool_calls`` when there are some):
        append it to the conversation, then the tools' results as ``{"role": "tool", ...}``."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [c.openai() for c in self.tool_calls]
        return message


def _stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list of non-empty strings (a lone string is one stop string)."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in items:
        if not isinstance(s, str):
            raise TypeError(f"stop must be a string or a list of strings, found {s!r} ({type(s).__name__})")
        if not s:
            raise ValueError("stop strings must be non-empty")
    return list(items)


class SamplingOptions(TypedDict, total=False):
    """The sampling keywords of `LLM.generate`, `LLM.stream` and `LLM.chat` (keyword-only, all optional).

    * ``temperature`` (default 0.0): 0 is greedy; > 0 samples from ``softmax(logits / temperature)``.
    * ``top_k`` (default 0: off): sample from the ``top_k`` most likely tokens.
    * ``top_p`` (default 1.0: off): sample from the smallest set of tokens reaching ``top_p``.
    * ``seed`` (default None: fresh randomness): makes sampling reproducible.
    * ``stop`` (default None): a stop string, or a list of them; generation ends before one.

    Structured output (at most one of the three; docs/structured.md):

    * ``json_schema``: the text is JSON matching this schema (a dict, its JSON text, or a
      pydantic model class; ``{"type": "object"}`` for any JSON object);
    * ``regex``: the whole text matches this regular expression;
    * ``grammar``: the text matches this grammar (llguidance's Lark dialect, or GBNF).

    Logits processing, as OpenAI's API and vLLM define it: ``logit_bias`` ({token id: bias in
    [-100, 100]} added to the logits), ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]),
    ``repetition_penalty`` (> 0; 1 is off).

    The defaults are `infer.generate.SamplingParams`'s; the checks are its and `_stop_strings`'.
    """

    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: str | Sequence[str] | None
    json_schema: Any
    regex: str | None
    grammar: str | None
    logit_bias: Mapping[int, float] | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float


@dataclass(frozen=True)
class _Processing:
    """The structured-output and logits-processing keywords of a call (`SamplingOptions`)."""

    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def active(self) -> bool:
        return self != _Processing()


def _generation_args(
    method: str, max_new_tokens: int, sampling: SamplingOptions
) -> tuple[int, SamplingParams, list[str], _Processing]:
    """``(max_new_tokens, SamplingParams, stop strings, processing)``, checked, from an `LLM`
    method's arguments.

    A keyword that is not a `SamplingOptions` key is a `TypeError` naming it, as Python's own.
    """
    for name in sampling:
        if name not in SamplingOptions.__annotations__:
            raise TypeError(f"LLM.{method}() got an unexpected keyword argument {name!r}")
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    options: dict[str, Any] = dict(sampling)
    stop = options.pop("stop", None)
    constraint = constraint_of(options.pop("json_schema", None), options.pop("regex", None),
                               options.pop("grammar", None))  # fmt: skip
    from infer.engine import SamplingParams as RequestParams

    penalties = {k: options.pop(k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                 if k in options}  # fmt: skip
    bias = options.pop("logit_bias", None)
    checked = RequestParams(logit_bias=bias or (), **penalties)  # the engine's checks, naming the keyword
    processing = _Processing(
        constraint, checked.logit_bias, checked.presence_penalty, checked.frequency_penalty,
        checked.repetition_penalty,
    )  # fmt: skip
    return max_new_tokens, SamplingParams(**options), _stop_strings(stop), processing


@dataclass(eq=False, repr=False)
class LLM:
    """A loaded model with its tokenizer: `generate`, `stream`, `chat` (`load` makes one).

    ``stepper`` runs its steps (`infer.step.Stepper`: eager, compiled or from packages);
    ``parallel`` is this rank's place in a parallel run (`infer.distributed`), else None.
    """

    config: ModelConfig
    tokenizer: Tokenizer
    model: DecoderLM
    source: Path
    stepper: Stepper
    speculative: Speculative | None = None  # speculative decoding (`infer.speculative`; set by `load`)
    parallel: Parallel | None = field(default=None, init=False)
    _engine: Engine | None = field(default=None, init=False)
    _engine_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    @property
    def engine(self) -> Engine:
        """The generation engine that owns this model's steps and KV slots (created on first use):
        `generate`, `stream` and `chat` go through it, from any thread (`infer.engine.Engine`)."""
        with self._engine_lock:
            if self._engine is None:
                from infer.engine import Engine

                self._engine = Engine(self)
            return self._engine

    @property
    def compiled(self) -> bool:
        """Whether generation runs the compiled step (`infer.step.Stepper`)."""
        return self.stepper.compiled

    @property
    def deterministic(self) -> bool:
        """Whether the model runs in the deterministic mode (docs/numerics.md)."""
        return is_deterministic(self.model)

    def __repr__(self) -> str:
        m = self.model
        return f"LLM({self.config.model_type}, {self.source}, dtype={m.dtype}, device={m.device})"

    @property
    def streaming_stats(self) -> Any:  # StreamingStats | None (Any: callers read its fields)
        """Layer-streaming statistics (`infer.streaming.StreamingStats`; None when the model is resident).

        Under pipeline parallelism: this rank's stage's (each stage streams its own layers).
        """
        return self.model.executor.stats

    # ---- prompts --------------------------------------------------------------

    def _encode(self, prompt: Prompt, what: str = "prompt") -> list[int]:
        """One prompt (a string, or a list of token ids) as checked token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{what} is empty (an empty string)")
            check_unicode(what, prompt)
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError(f"{what} encodes to no tokens")
            return ids
        if not isinstance(prompt, list | tuple):
            raise TypeError(f"{what} must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"{what} is empty (an empty list of token ids)")
        vocab = self.config.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not hasattr(type(t), "__index__"):
                raise TypeError(f"{what}: token ids must be ints, found {t!r} ({type(t).__name__})")
            if not 0 <= operator.index(t) < vocab:
                raise ValueError(f"{what}: token id {t} is out of range [0, {vocab})")
        return [operator.index(t) for t in prompt]

    def _encode_batch(self, prompt: Any) -> tuple[list[list[int]], bool]:
        """``(token ids per prompt, is_batch)`` for a prompt or a list of prompts."""
        if (
            isinstance(prompt, list | tuple)
            and prompt
            and all(isinstance(p, str | list | tuple) for p in prompt)
        ):
            return [self._encode(p, f"prompt {i}") for i, p in enumerate(prompt)], True
        if (
            isinstance(prompt, list | tuple)
            and prompt
            and any(isinstance(p, str | list | tuple) for p in prompt)
        ):
            raise TypeError("a batch of prompts must hold only strings or lists of token ids")
        return [self._encode(prompt)], False

    def _eos_ids(self) -> list[int]:
        ids = list(self.tokenizer.eos_token_ids)
        for i in self.config.eos_token_ids:
            if i not in ids:
                ids.append(i)
        return ids

    def _run(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams,
        stop: Sequence[str],
        timings: dict[str, float] | None = None,
    ) -> Iterator[list[RowState]]:
        """Under tensor/pipeline parallelism: every rank runs the same batch in lockstep (no engine
        thread, whose admission timing could differ between ranks)."""
        assert self.parallel is not None

        def stop_check(row: int, tokens: list[int]) -> bool:
            return cut_at_stop(self.tokenizer.decode(tokens), stop)[1]

        eos_ids = self._eos_ids()
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = eos_ids[0] if eos_ids else 0
        if not params.greedy and params.seed is None:
            from infer.distributed import shared_seed

            # Every rank must draw the same tokens: one seed, chosen by rank 0.
            params = dataclasses.replace(params, seed=shared_seed(self.parallel))
        steps = generate_steps(
            self.model,
            prompts,
            max_new_tokens=max_new_tokens,
            params=params,
            eos_ids=eos_ids,
            pad_id=pad_id,
            stop_check=stop_check if stop else None,
            timings=timings,
            stepper=self.stepper,
        )
        from infer.distributed.runtime import peer_failures

        with peer_failures(self.parallel):  # a rank that stops answering is named on the others
            yield from steps

    def _generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams,
        stops: list[str],
        processing: _Processing = _Processing(),
    ) -> list[GenerationResult]:
        """Every prompt through the engine (continuous batching); results in prompt order."""
        if self.parallel is not None:
            _no_processing_in_parallel(processing)
            timings: dict[str, float] = {}  # this call's own
            rows = run_to_end(self._run(prompts, max_new_tokens, params, stops, timings))
            return [
                GenerationResult(
                    text=cut_at_stop(self.tokenizer.decode(r.tokens), stops)[0],
                    token_ids=list(r.tokens),
                    prompt_tokens=r.prompt_len,
                    finish_reason=r.finish_reason or "length",
                    prefill_seconds=timings.get("prefill_s", 0.0),
                    decode_seconds=timings.get("decode_s", 0.0),
                )
                for r in rows
            ]
        handles = self._submit(prompts, max_new_tokens, params, stops, processing, text=False)
        try:
            results = []
            for i, h in enumerate(handles):
                text = "".join(d.text for d in h)
                results.append(self._result(h, text, i, processing.constraint))
            return results
        finally:
            for h in handles:
                h.cancel()
            self.engine._settle()

    def _submit(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams,
        stops: list[str],
        processing: _Processing,
        *,
        text: bool,
    ) -> list[RequestHandle]:
        from infer.engine import SamplingParams as RequestParams

        def request(i: int) -> RequestParams:
            seed = params.seed
            if seed is not None and not params.greedy:
                seed = row_seed(seed, i)  # each prompt of a batch draws its own numbers
            return RequestParams(
                max_tokens=max_new_tokens, temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, seed=seed, stop=tuple(stops), constraint=processing.constraint,
                logit_bias=processing.logit_bias, presence_penalty=processing.presence_penalty,
                frequency_penalty=processing.frequency_penalty,
                repetition_penalty=processing.repetition_penalty,
            )  # fmt: skip

        requests = [request(i) for i in range(len(prompts))]
        return self.engine._submit(prompts, requests, text=text, wait=True, drive=True)

    def _result(
        self, h: RequestHandle, text: str, row: int, constraint: Constraint | None = None
    ) -> GenerationResult:
        if h.finish_detail == "error":
            error = h.exception
            if isinstance(error, NonFiniteLogitsError):
                raise NonFiniteLogitsError(
                    f"{error}, batch row {row}: "
                    "the weights hold NaN/inf or the activations overflowed (try dtype=torch.float32)"
                )
            if error is not None:
                raise error
            raise RuntimeError(f"generation failed for prompt {row}")
        finish = h.finish_detail if h.finish_detail in ("eos", "stop") else "length"
        parsed = None
        if constraint is not None and constraint.kind == "json_schema" and finish != "length":
            parsed = _parse_json(text, constraint.model)
        return GenerationResult(
            text=text,
            token_ids=list(h.token_ids),
            prompt_tokens=h.prompt_tokens,
            finish_reason=finish,
            prefill_seconds=h.prefill_seconds,
            decode_seconds=h.decode_seconds,
            parsed=parsed,
        )

    # ---- public ---------------------------------------------------------------

    @overload
    def generate(
        self, prompt: Prompt, max_new_tokens: int = ..., **sampling: Unpack[SamplingOptions]
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        prompt: list[str] | list[list[int]],
        max_new_tokens: int = ...,
        **sampling: Unpack[SamplingOptions],
    ) -> list[GenerationResult]: ...

    def generate(
        self,
        prompt: Prompt | list[str] | list[list[int]],
        max_new_tokens: int = 128,
        **sampling: Unpack[SamplingOptions],
    ) -> GenerationResult | list[GenerationResult]:
        """Generate a continuation of ``prompt``.

        ``prompt`` is a string, a list of token ids, or a list of either (a batch,
        returns a list; the prompts go through `engine` with continuous batching, each
        getting what it would alone, prompt ``i`` of a seeded batch drawing from seed
        ``infer.generate.row_seed(seed, i)``).

        The sampling keywords (`SamplingOptions`): ``temperature`` (default 0.0: greedy);
        with ``temperature > 0`` sampling uses ``top_k`` (default 0: off) / ``top_p``
        (default 1.0: off) and ``seed`` (default None) makes it reproducible. Generation
        stops at any EOS id of the model, at any of the ``stop`` strings (default None: a
        string or a list of strings), or after ``max_new_tokens`` (an int >= 1; fewer when
        the model's context ends first).

        Arguments are checked before anything runs: `TypeError` for a wrong type or an
        unknown keyword, `ValueError` for a value out of range (``temperature`` finite and >= 0,
        ``top_k`` in [0, 2**63 - 1], ``top_p`` in (0, 1], ``seed`` in [0, 2**64 - 1], non-empty
        prompts and stop strings, token ids < vocab size). Non-finite logits raise
        `infer.generate.NonFiniteLogitsError` naming the step and the batch row.

        Structured output: ``json_schema=`` (a dict, JSON text or a pydantic model class; the
        result's ``parsed`` holds the decoded value or model instance), ``regex=`` or ``grammar=``
        (Lark or GBNF) constrain every generated token, so the text matches (unless
        ``max_new_tokens`` ends it first: ``finish_reason`` "length"). A constraint that does not
        compile is a `ValueError` naming the keyword (`infer.structured.ConstraintError`).
        ``logit_bias``, ``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty``
        process the logits as OpenAI's API and vLLM do (`SamplingOptions`).
        """
        max_new_tokens, params, stops, processing = _generation_args("generate", max_new_tokens, sampling)
        prompts, batch = self._encode_batch(prompt)
        results = self._generate(prompts, max_new_tokens, params, stops, processing)
        return results if batch else results[0]

    def stream(
        self, prompt: Prompt, max_new_tokens: int = 128, **sampling: Unpack[SamplingOptions]
    ) -> Iterator[str]:
        """Like `generate` for one prompt, yielding text pieces as they are decoded.

        The sampling keywords are `generate`'s (`SamplingOptions`: ``temperature``, ``top_k``,
        ``top_p``, ``seed``, ``stop``, the constraints and penalties), checked on the call, not on
        the first ``next()``."""
        max_new_tokens, params, stops, processing = _generation_args("stream", max_new_tokens, sampling)
        prompts, batch = self._encode_batch(prompt)
        if batch:
            raise TypeError("stream() takes one prompt; use generate() for a batch")
        if self.parallel is not None:
            _no_processing_in_parallel(processing)
        elif processing.active:  # compile the constraint now: its errors belong to this call
            if processing.constraint is not None:
                self.engine.grammars.matcher(processing.constraint)
            check_logit_bias(processing.logit_bias, self.model.vocab_size)
        return self._stream(prompts[0], max_new_tokens, params, stops, processing)

    def _stream(
        self,
        ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        stops: list[str],
        processing: _Processing,
    ) -> Iterator[str]:
        if self.parallel is not None:
            out = TextStream(self.tokenizer)
            last: RowState | None = None
            for rows in self._run([ids], max_new_tokens, params, stops):
                last = rows[0]
                if last.finish_reason is None:
                    piece = out.push(last.tokens, stops)  # a stop string may be forming
                    if piece:
                        yield piece
            if last is not None:
                final = cut_at_stop(self.tokenizer.decode(last.tokens), stops)[0]
                if final.startswith(out.emitted) and len(final) > len(out.emitted):
                    yield final[len(out.emitted) :]
            return
        (handle,) = self._submit([ids], max_new_tokens, params, stops, processing, text=True)
        try:
            for delta in handle:
                if delta.finish_reason == "error":
                    self._result(handle, "", 0)  # raises
                if delta.text:
                    yield delta.text
        finally:
            handle.cancel()  # a generator closed early frees its row
            self.engine._settle()

    def chat(
        self,
        messages: Sequence[Message],
        max_new_tokens: int = 256,
        *,
        parse_special_in_content: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        **sampling: Unpack[SamplingOptions],
    ) -> GenerationResult:
        """Apply the tokenizer's chat template to ``messages`` and generate the assistant's reply.

        ``messages`` is a list of dicts with string ``role`` and ``content``. Message
        strings are encoded as text: ``"<|im_end|>"`` typed by a user stays text, only
        the template writes control tokens. ``parse_special_in_content=True`` turns
        control-token spellings in messages into control tokens (transformers' default).
        The other arguments are `generate`'s: ``max_new_tokens`` and the sampling keywords
        (`SamplingOptions`: ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, the
        constraints and penalties).

        ``tools`` (OpenAI's function definitions) are offered to the model in its family's
        format (`infer.tools`: Qwen's ``<tool_call>``, Llama 3's JSON, Mistral's ``[TOOL_CALLS]``,
        else described by infer in the system message); the calls it makes come back parsed in
        ``tool_calls`` (``finish_reason`` "tool_calls"), the text around them in ``text``.
        ``tool_choice``: "auto" (default), "none", "required", or
        ``{"type": "function", "function": {"name": ...}}`` — the last two constrain generation
        so the reply is a call (``parallel_tool_calls``: one or more) whose arguments match the
        function's ``parameters``. Conversations go on with ``result.message`` and
        ``{"role": "tool", "tool_call_id": ..., "content": ...}`` messages.
        """
        from infer.prompts import read_reply, tool_chat

        max_new_tokens, params, stops, processing = _generation_args("chat", max_new_tokens, sampling)
        if not isinstance(parse_special_in_content, bool):
            raise TypeError(f"parse_special_in_content must be a bool, got {parse_special_in_content!r}")
        if tools is None and tool_choice is None:
            ids = self.chat_prompt(messages, parse_special_in_content=parse_special_in_content)
            # The engine keeps the conversation's KV in its row: the next turn, whose rendered
            # history starts with these tokens and the reply, prefills only what is new.
            return self._generate([ids], max_new_tokens, params, stops, processing)[0]
        chat = tool_chat(
            self, messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
            constraint=processing.constraint, parse_special_in_content=parse_special_in_content,
        )  # fmt: skip
        processing = dataclasses.replace(processing, constraint=chat.constraint)
        result = self._generate([chat.ids], max_new_tokens, params, stops, processing)[0]
        content, calls = read_reply(self, chat, result.token_ids, result.text)
        if calls:
            result.text, result.tool_calls, result.finish_reason, result.parsed = (
                content,
                calls,
                "tool_calls",
                None,
            )
        return result

    def perplexity(
        self, text: str, context: int = DEFAULT_CONTEXT, **options: Unpack[PerplexityOptions]
    ) -> PerplexityResult:
        """Perplexity over ``text`` as ``llama-perplexity -c context -b context`` computes it:
        chunks of ``context`` tokens, the second half of each scored. The keywords (``batch``,
        ``max_chunks``, ``progress``), their defaults and the checks are `infer.perplexity.perplexity`'s."""
        from infer.perplexity import perplexity

        return perplexity(self, text, context, **options)

    def chat_prompt(
        self, messages: Sequence[Message], *, parse_special_in_content: bool = False
    ) -> list[int]:
        """The token ids of ``messages`` rendered by the chat template, with the assistant's turn opened."""
        if not isinstance(parse_special_in_content, bool):
            raise TypeError(f"parse_special_in_content must be a bool, got {parse_special_in_content!r}")
        return self.tokenizer.encode_chat(
            messages, add_generation_prompt=True, parse_special_in_content=parse_special_in_content
        )


def _no_processing_in_parallel(processing: _Processing) -> None:
    if processing.active:
        raise ValueError(
            "json_schema, regex, grammar, logit_bias and the penalties need the engine: "
            "tensor- and pipeline-parallel generation runs without one"
        )


def _parse_json(text: str, model: Any) -> Any:
    """The JSON in ``text``: a ``model`` instance (pydantic) when given; None when it does not parse."""
    import json

    try:
        return model.model_validate_json(text) if model is not None else json.loads(text)
    except ValueError:
        return None


def load(
    path_or_hub_id: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    quantize: str | None = None,
    streaming: StreamingConfig | None = None,
    progress: ProgressFn | None = None,
    validate: bool = True,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    compile: bool | Literal["auto"] | None = None,
    deterministic: bool = False,
    cache: bool = True,
    lookup: int = 0,
    draft: str | os.PathLike[str] | LLM | None = None,
    speculative_tokens: int | None = None,
    kv_dtype: str | torch.dtype | None = None,
) -> LLM:
    """Load a checkpoint and its tokenizer into an `LLM`.

    ``path_or_hub_id``: a directory with ``config.json`` + safetensors (+ tokenizer
    files), a ``.gguf`` file, or a hub id already in the local HF cache (or
    downloadable). ``dtype`` defaults to the checkpoint's; a GGUF file's default is
    float32 activations with its packed matrix products in bfloat16 (``dtype=
    torch.float32`` computes everything in float32: exact, slower). ``quantize`` ("q4_0"
    or "int8") quantizes the weight matrices of a safetensors checkpoint at load time.
    ``streaming`` runs the layers through the device under a memory budget instead of
    keeping them resident. ``validate`` refuses weights holding NaN or inf (a pass over
    every weight; streamed weights are checked the first time they are read).
    ``progress(done, total)`` is called as modules load.

    ``tensor_parallel`` / ``pipeline_parallel`` (T, P): run across ``T x P`` processes of
    `torch.distributed` (under ``torchrun``, or any initialized default process group;
    without one it is initialized from torchrun's environment variables: gloo on CPU,
    NCCL on CUDA). Every rank calls ``load`` with the same arguments and reads only its
    part of the weights; generation then gives the same result on every rank. See
    docs/distributed.md.

    ``compile`` (resident models only; `infer.step`): ``"auto"`` runs each decode step from an
    ahead-of-time compiled package of its shape in the user's cache directory, and eagerly
    where there is none (`infer.aot`: the missing shapes are built after the process, while the
    machine is otherwise idle; CPU, outside the deterministic mode; prefill stays eager); ``True`` compiles
    every step in this process with ``torch.compile`` (the first request of each new (batch,
    length) bucket waits for it); ``False`` never compiles. ``None`` means `compile_by_default`.

    ``deterministic`` runs every matrix product on fixed tiles of rows and attention on
    fixed tiles of queries and keys, so a prompt's logits are bitwise the same whatever
    else is in its batch, however its prompt is chunked, and whether its layers are
    resident or streamed — on any CPU. It costs speed at small batches (a batch of one
    computes a tile of 16 rows); docs/numerics.md has the contract and the figures.

    ``cache``: keep what loading computes from a GGUF file (its matrices converted for the
    packed kernels) in a file under the user's cache directory, and reuse it in later
    processes while the GGUF file is unchanged (`infer.loader.repack_cache`; resident,
    single-process loads). ``cache=False`` converts every time and writes nothing.

    ``kv_dtype``: what the KV cache holds ("float32", "bfloat16", "float16", or "int8": int8
    values with a float32 scale per token and head); narrower K/V are widened to the
    activations' dtype when attention reads them. None: `default_kv_dtype` (the model's dtype on
    CPU; docs/engine.md, *KV memory*, has the memory and speed of each, docs/numerics.md the
    perplexity).

    Speculative decoding (docs/speculative.md; every `generate` / `stream` / `chat` call and the
    server use it): ``lookup=N`` proposes tokens by n-gram lookup in the prompt and the text so far
    (the last N tokens, then fewer); ``draft`` proposes them with a draft model: a path (loaded
    on ``device`` at its default settings and this ``kv_dtype``), an `LLM`, or ``"self"`` (this
    checkpoint's weights packed: a GGUF file at its default, packed products, safetensors
    quantized to Q4_0). Its tokenizer must equal this one's (`ValueError` naming the first token
    that differs). A request with a constraint, a logit bias or a penalty never speculates, and a
    decode step it takes part in is a plain one (docs/speculative.md).
    ``speculative_tokens`` bounds the tokens proposed per pass (default 16); each pass proposes
    what its measured cost and the acceptance so far say pays, down to none. Greedy tokens are
    plain decoding's (bitwise in the deterministic mode); sampled tokens are distributed as the
    model's.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    device = torch.device(device)
    parallel = tensor_parallel != 1 or pipeline_parallel != 1
    if compile is not None and not isinstance(compile, bool) and compile != "auto":
        error = ValueError if isinstance(compile, str) else TypeError
        raise error(f"compile must be True, False, 'auto' or None, got {compile!r}")
    if compile is True and streaming is not None:
        raise ValueError("compile=True applies to resident models; a streamed model runs eagerly")
    if compile is True and parallel:
        raise ValueError(
            "compile=True applies to one process; tensor- and pipeline-parallel models run eagerly"
        )
    use_compile = compile_by_default(device) if compile is None else compile
    if streaming is not None or parallel:
        use_compile = False
    checkpoint = open_checkpoint(path_or_hub_id)
    options = checkpoint.options(
        dtype, quantize=quantize, validate=validate, device=device, streaming=streaming,
        tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        deterministic=deterministic, repack_cache=cache, progress=progress,
    )  # fmt: skip
    kv = resolve_kv_dtype(kv_dtype)  # checked before the (slow) load
    tokenizer = checkpoint.tokenizer()
    model, placed = build_model(checkpoint, options)
    model.kv_dtype = kv if kv is not None else default_kv_dtype(model)
    packages = None
    if use_compile == "auto" and device.type == "cpu" and not deterministic and aot_pays(model):
        # Ahead-of-time compiled decode steps (infer.aot); the recipe rebuilds this model for a build.
        dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
        kv_name = str(model.cache_dtype).removeprefix("torch.")
        packages = PackageCache(model, Recipe(str(checkpoint.path), dtype_name, quantize, kv_dtype=kv_name))
    stepper = Stepper(model, compile=use_compile, packages=packages)
    llm = LLM(checkpoint.config, tokenizer, model, checkpoint.path, stepper)
    llm.parallel = placed
    if lookup or draft is not None or speculative_tokens is not None:
        args = (lookup, draft, speculative_tokens, device, deterministic, kv_dtype)
        llm.speculative = _speculative(llm, *args)
    return llm


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``load``'s ``kv_dtype`` as a torch dtype (None: `default_kv_dtype`); a clear error otherwise."""
    from infer.cache import KV_DTYPES

    if kv_dtype is None or kv_dtype == "auto":
        return None
    if isinstance(kv_dtype, torch.dtype):
        kv_dtype = str(kv_dtype).removeprefix("torch.")
    if not isinstance(kv_dtype, str):
        raise TypeError(f"kv_dtype must be a string or a torch.dtype, got {type(kv_dtype).__name__}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None), got {kv_dtype!r}")
    dtype: torch.dtype = getattr(torch, kv_dtype)
    return dtype


def default_kv_dtype(model: DecoderLM) -> torch.dtype | None:
    """The KV dtype of a model loaded without ``kv_dtype``: on CUDA, bfloat16 where its matrix
    products are packed bfloat16 products under wider activations (a GGUF file's default); else
    None, the model's own dtype. On CPU a narrower KV costs more than it saves: torch's fused
    attention runs 2-8x slower on bfloat16 inputs than on float32 ones (and widening each step's
    keys costs a copy), measured on decode shapes of SmolLM2 on an AMD EPYC (docs/engine.md)."""
    from infer.quant.linear import QuantizedLinear

    if model.device.type != "cuda" or model.dtype in (torch.bfloat16, torch.float16):
        return None
    products = {m.compute_dtype for m in model.modules() if isinstance(m, QuantizedLinear)}
    return torch.bfloat16 if torch.bfloat16 in products else None


def _speculative(
    llm: LLM,
    lookup: int,
    draft: str | os.PathLike[str] | LLM | None,
    tokens: int | None,
    device: torch.device,
    deterministic: bool,
    kv_dtype: str | torch.dtype | None = None,
) -> Speculative:
    """`load`'s speculative settings, checked, with the draft model loaded."""
    from infer.speculative import DEFAULT_TOKENS, Speculative, check_draft

    if llm.parallel is not None:
        raise ValueError("speculative decoding runs in one process; not under tensor/pipeline parallelism")
    if lookup == 0 and draft is None:
        raise ValueError("speculative_tokens needs lookup >= 1 or a draft model")
    if isinstance(draft, str) and draft == "self":
        if llm.source.suffix == ".gguf":  # its default: packed products on bfloat16 activations
            draft = load(llm.source, device=device, deterministic=deterministic, kv_dtype=kv_dtype)
        else:
            draft = load(llm.source, device=device, quantize="q4_0", deterministic=deterministic,
                         kv_dtype=kv_dtype)  # fmt: skip
    elif draft is not None and not isinstance(draft, LLM):
        draft = load(draft, device=device, deterministic=deterministic, kv_dtype=kv_dtype)
    if draft is not None:
        check_draft(llm, draft)
    return Speculative(lookup, draft, DEFAULT_TOKENS if tokens is None else tokens)


def compile_by_default(device: torch.device) -> bool | Literal["auto"]:
    """What `load` compiles when ``compile`` is not given: ``"auto"`` on CPU, nothing elsewhere.

    ``"auto"`` never waits for a compiler: a decode step runs a package built ahead of time
    by another process, or eagerly where there is none (`infer.aot`; the missing shapes are
    built after the process, in the machine's idle time). Measured (docs/performance.md,
    *Compiled by default*). On CUDA packages are not built yet: ``compile=True`` there.
    """
    return "auto" if device.type == "cpu" else False
