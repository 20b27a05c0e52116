"""`LLM`: a loaded model and its tokenizer, and what it generates (`generate`, `stream`, `chat`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack, overload

from infer.execution import Execution
from infer.lens import ActivationCache
from infer.loader.config import ModelConfig
from infer.loader.tokenizer import Tokenizer
from infer.loading import resolve_checkpoint as resolve_checkpoint  # kept importable here
from infer.loading import resolve_dtype as resolve_dtype  # (the CLI imports it from here)
from infer.models.base import DecoderLM
from infer.models.projections import is_deterministic
from infer.notebook import NotebookMethods
from infer.params import NonFiniteLogitsError, SamplingParams, check_max_new_tokens
from infer.perplexity import DEFAULT_CONTEXT, PerplexityOptions
from infer.text.prompts import chat_prompt, encode_prompt
from infer.text.structured import Constraint, constraint_of
from infer.text.tools import ToolCall

if TYPE_CHECKING:
    from infer.distributed import Parallel
    from infer.engine import Engine, RequestHandle
    from infer.engine.parallel import Ranks
    from infer.perplexity import PerplexityResult
    from infer.speculative import Speculative

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
    instance of the pydantic model when one was given, else the decoded value. ``activations``:
    inside ``llm.hooks(cache=...)``, the kept points at every position fed (the prompt, then each
    generated token but the last: ``[prompt_tokens + len(token_ids) - 1, ...]``).
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "stop", "length" or "tool_calls"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    tool_calls: list[ToolCall] = field(default_factory=list)
    parsed: Any = None
    activations: ActivationCache | None = None

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


class SamplingOptions(TypedDict, total=False):
    """The sampling keywords of `LLM.generate`, `LLM.stream` and `LLM.chat` (keyword-only, all optional).

    Each is the `infer.params.SamplingParams` field of its name, with its default and its check
    (one call: `_generation_args`): ``temperature`` (0.0: greedy), ``top_k`` (0: off), ``top_p``
    (1.0: off), ``seed`` (None: fresh randomness), ``stop`` (a string or a list of them; generation
    ends before one), and the logits processing of OpenAI's API and vLLM: ``logit_bias`` ({token
    id: bias}), ``presence_penalty`` / ``frequency_penalty``, ``repetition_penalty`` (1: off).

    Besides them, structured output (at most one of the three; docs/structured.md):

    * ``json_schema``: the text is JSON matching this schema (a dict, its JSON text, or a
      pydantic model class; ``{"type": "object"}`` for any JSON object);
    * ``regex``: the whole text matches this regular expression;
    * ``grammar``: the text matches this grammar (llguidance's Lark dialect, or GBNF).
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


def _generation_args(method: str, max_new_tokens: int, sampling: SamplingOptions) -> SamplingParams:
    """The `SamplingParams` of an `LLM` method's arguments, checked.

    A keyword that is not a `SamplingOptions` key is a `TypeError` naming it, as Python's own.
    """
    for name in sampling:
        if name not in SamplingOptions.__annotations__:
            raise TypeError(f"LLM.{method}() got an unexpected keyword argument {name!r}")
    options: dict[str, Any] = dict(sampling)
    constraint = constraint_of(options.pop("json_schema", None), options.pop("regex", None),
                               options.pop("grammar", None))  # fmt: skip
    return SamplingParams(max_tokens=check_max_new_tokens(max_new_tokens), constraint=constraint, **options)


@dataclass(eq=False, repr=False)
class LLM(NotebookMethods):
    """A loaded model with its tokenizer: `generate`, `stream`, `chat` (`load` makes one); for
    notebooks (`infer.notebook.NotebookMethods`): `intervene`, `score`, `logit_lens`, a summary
    as its ``repr``; ``llm.model(ids, output_hidden_states=True, output_attentions=True)``.

    ``execution`` runs its steps (`infer.execution.Execution`: eager, compiled or from packages);
    ``parallel`` is this rank's place in a parallel run (`infer.distributed`), else None.
    """

    config: ModelConfig
    tokenizer: Tokenizer
    model: DecoderLM
    source: Path
    execution: Execution
    speculative: Speculative | None = None  # speculative decoding (`infer.speculative`; set by `load`)
    parallel: Parallel | None = field(default=None, init=False)
    _engine: Engine | None = field(default=None, init=False)
    _engine_options: dict[str, Any] = field(default_factory=dict, init=False)  # what it was made with
    _engine_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    @property
    def engine(self) -> Engine:
        """The generation engine that owns this model's steps and KV slots (created on first use):
        `generate`, `stream` and `chat` go through it, from any thread (`infer.engine.Engine`).
        Under tensor/pipeline parallelism it lives on rank 0; the other ranks follow it
        (`ranks`)."""
        return self.start_engine()

    def start_engine(self, **options: Any) -> Engine:
        """The engine, made with ``options`` (`infer.engine.Engine`'s keywords: ``max_batch``,
        ``max_waiting``, ...) if it does not exist yet; `ValueError` if it runs with others, and
        `TypeError` for a keyword the engine does not take (whether or not it exists yet)."""
        if not self.primary:
            raise RuntimeError(
                f"rank {self.parallel.rank if self.parallel else 0} follows rank 0's engine: "
                "only rank 0 has one (call the same LLM methods on every rank)"
            )
        import inspect

        from infer.engine import Engine

        defaults = {
            name: p.default
            for name, p in inspect.signature(Engine.__init__).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "runner"  # runner: this LLM's own
        }
        unknown = [key for key in options if key not in defaults]
        if unknown:
            raise TypeError(
                f"start_engine() got an unexpected keyword argument {unknown[0]!r}; "
                f"the engine's settings are {', '.join(defaults)}"
            )
        with self._engine_lock:
            if self._engine is None:
                runner = None if self.parallel is None else self.ranks.runner
                self._engine = Engine(self, runner=runner, **options)
                self._engine_options = dict(options)
                return self._engine
            engine, made = self._engine, {**defaults, **self._engine_options}
        # Asked as it was made (what was asked then, not what the engine derived: context=None
        # is the model's positions, a streamed model's max_batch is lowered to what fits).
        for key, value in options.items():
            if made[key] != value:
                raise ValueError(
                    f"this LLM's engine already runs with {key}={made[key]!r}, not {value!r} "
                    "(its settings are fixed when it is made)"
                )
        return engine

    @property
    def primary(self) -> bool:
        """Whether this process runs the engine (one process, or rank 0 of a parallel run)."""
        return self.parallel is None or self.parallel.rank == 0

    @cached_property
    def ranks(self) -> Ranks:
        """This process's part in a parallel run (`infer.engine.parallel.Ranks`): rank 0's engine
        sends every step to the other ranks, which follow it (`Ranks.follow` in a server)."""
        from infer.engine.parallel import Ranks

        if self.parallel is None:
            raise RuntimeError("this LLM runs in one process (no tensor/pipeline parallelism)")
        return Ranks(self.parallel, self.model, self.execution)

    @property
    def compiled(self) -> bool:
        """Whether generation runs the compiled step (`infer.execution.Execution`)."""
        return self.execution.compiled

    @property
    def deterministic(self) -> bool:
        """Whether the model runs in the deterministic mode (docs/numerics.md)."""
        return is_deterministic(self.model)

    @property
    def streaming_stats(self) -> Any:  # StreamingStats | None (Any: callers read its fields)
        """Layer-streaming statistics (`infer.streaming.StreamingStats`; None when the model is resident).

        Under pipeline parallelism: this rank's stage's (each stage streams its own layers).
        """
        return self.model.executor.stats

    # ---- prompts --------------------------------------------------------------

    def encode(self, prompt: Prompt, what: str = "prompt") -> list[int]:
        """One prompt (a string, or a list of token ids) as checked token ids
        (`infer.text.prompts.encode_prompt`)."""
        return encode_prompt(self.tokenizer, self.config.vocab_size, prompt, what)

    def _encode_batch(self, prompt: Any) -> tuple[list[list[int]], bool]:
        """``(token ids per prompt, is_batch)`` for a prompt or a list of prompts."""
        many = isinstance(prompt, list | tuple) and len(prompt) > 0
        items = [isinstance(p, str | list | tuple) for p in prompt] if many else []
        if items and all(items):
            return [self.encode(p, f"prompt {i}") for i, p in enumerate(prompt)], True
        if any(items):
            raise TypeError("a batch of prompts must hold only strings or lists of token ids")
        return [self.encode(prompt)], False

    @property
    def eos_ids(self) -> list[int]:
        """Every id that ends a generation: the tokenizer's EOS ids, then the config's."""
        ids = list(self.tokenizer.eos_token_ids)
        for i in self.config.eos_token_ids:
            if i not in ids:
                ids.append(i)
        return ids

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        """Every prompt (token ids `encode` checked) through the engine (continuous batching); results
        in prompt order. Under tensor/pipeline parallelism rank 0 runs them and the other ranks
        return its results."""
        if not self.primary:
            results: list[GenerationResult] = self.ranks.followed()
            return results
        try:
            handles = self._submit(prompts, params, text=False)
            try:
                results = []
                for i, h in enumerate(handles):
                    text = "".join(d.text for d in h)
                    results.append(self._result(h, text, i, params.constraint))
            finally:
                for h in handles:
                    h.cancel()
                self.engine.settle()
        except BaseException as e:
            self._end_call(e if isinstance(e, Exception) else RuntimeError("rank 0 was interrupted"))
            raise
        self._end_call(results)
        return results

    def _end_call(self, result: Any) -> None:
        """Rank 0 of a parallel run: the call is over; the other ranks return ``result`` (or raise it)."""
        if self.parallel is not None:
            self.ranks.end_call(result)

    def _submit(self, prompts: list[list[int]], params: SamplingParams, *, text: bool) -> list[RequestHandle]:
        """The encoded prompts (`encode`) queued, each with its row's settings (its own seed)."""
        rows = [params.row(i) for i in range(len(prompts))]
        return self.engine.submit_many(prompts, rows, text=text, wait=True, drive=True, checked=True)

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
            activations=h.activations,
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
        ``infer.params.row_seed(seed, i)``).

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
        `infer.NonFiniteLogitsError` naming the step and the batch row.

        Structured output: ``json_schema=`` (a dict, JSON text or a pydantic model class; the
        result's ``parsed`` holds the decoded value or model instance), ``regex=`` or ``grammar=``
        (Lark or GBNF) constrain every generated token, so the text matches (unless
        ``max_new_tokens`` ends it first: ``finish_reason`` "length"). A constraint that does not
        compile is a `ValueError` naming the keyword (`infer.text.structured.ConstraintError`).
        ``logit_bias``, ``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty``
        process the logits as OpenAI's API and vLLM do (`SamplingOptions`).
        """
        params = _generation_args("generate", max_new_tokens, sampling)
        prompts, batch = self._encode_batch(prompt)
        results = self._generate(prompts, params)
        return results if batch else results[0]

    def stream(
        self, prompt: Prompt, max_new_tokens: int = 128, **sampling: Unpack[SamplingOptions]
    ) -> Iterator[str]:
        """Like `generate` for one prompt, yielding text pieces as they are decoded.

        The sampling keywords are `generate`'s (`SamplingOptions`: ``temperature``, ``top_k``,
        ``top_p``, ``seed``, ``stop``, the constraints and penalties), checked on the call, not on
        the first ``next()``. Under tensor/pipeline parallelism ranks other than 0 yield the
        whole text once, at the end. Made inside ``with llm.hooks(...)``, the stream carries that
        block's hooks (captured on this call, as `generate` carries them); its first ``next()``
        after the block ended is a `RuntimeError` (the hooks are off: it would run unhooked)."""
        params = _generation_args("stream", max_new_tokens, sampling)
        prompts, batch = self._encode_batch(prompt)
        if batch:
            raise TypeError("stream() takes one prompt; use generate() for a batch")
        if params.constraint is not None and self.primary:  # compiled now: its errors belong to this call
            self.engine.grammars.matcher(params.constraint)
        from infer.models.hooks import submission_scope

        return self._stream(prompts[0], params, submission_scope())

    def _stream(self, ids: list[int], params: SamplingParams, scope: Any = None) -> Iterator[str]:
        """The generator of `stream`: submits at its first ``next()``, under ``scope`` (the
        `infer.lens.hooks` session `stream` was called in, None: none)."""
        from infer.models.hooks import submitting

        if not self.primary:
            text: str = self.ranks.followed()
            if text:
                yield text
            return
        if scope is not None and getattr(scope, "closed", False):
            raise RuntimeError(
                "stream(): made inside llm.hooks(...) but first read after the block ended: its hooks "
                "are off, so it would run unhooked; read the stream inside the block"
            )
        pieces: list[str] = []
        failure: Exception | None = None
        try:
            with submitting(scope):  # the hooks of the block `stream` was called in
                (handle,) = self._submit([ids], params, text=True)
            try:
                for delta in handle:
                    if delta.finish_reason == "error":
                        self._result(handle, "", 0)  # raises
                    if delta.text:
                        pieces.append(delta.text)
                        yield delta.text
            finally:
                handle.cancel()  # a generator closed early frees its row
                self.engine.settle()
        except Exception as e:
            failure = e
            raise
        finally:
            if self.parallel is not None:
                self._end_call(failure if failure is not None else "".join(pieces))

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
        format (`infer.text.tools`: Qwen's ``<tool_call>``, Llama 3's JSON, Mistral's ``[TOOL_CALLS]``,
        else described by infer in the system message); the calls it makes come back parsed in
        ``tool_calls`` (``finish_reason`` "tool_calls"), the text around them in ``text``.
        ``tool_choice``: "auto" (default), "none", "required", or
        ``{"type": "function", "function": {"name": ...}}`` — the last two constrain generation
        so the reply is a call (``parallel_tool_calls``: one or more) whose arguments match the
        function's ``parameters``. Conversations go on with ``result.message`` and
        ``{"role": "tool", "tool_call_id": ..., "content": ...}`` messages.
        """
        from infer.text.prompts import read_reply, tool_chat

        params = _generation_args("chat", max_new_tokens, sampling)
        if tools is None and tool_choice is None:
            ids = self.chat_prompt(messages, parse_special_in_content=parse_special_in_content)
            # The engine keeps the conversation's KV in its row: the next turn, whose rendered
            # history starts with these tokens and the reply, prefills only what is new.
            return self._generate([self.encode(ids)], params)[0]
        chat = tool_chat(
            self, messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
            constraint=params.constraint, parse_special_in_content=parse_special_in_content,
        )  # fmt: skip
        params = dataclasses.replace(params, constraint=chat.constraint)
        result = self._generate([self.encode(chat.ids)], params)[0]
        cut = result.finish_reason == "length"  # cut inside its calls: it ended by length, not in calls
        content, calls = read_reply(self, chat, result.token_ids, result.text, cut=cut)
        result.text = content
        if calls:
            result.tool_calls = calls
            result.finish_reason = result.finish_reason if cut else "tool_calls"
            result.parsed = None
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
        """The token ids of ``messages`` rendered by the chat template, with the assistant's turn opened
        (`infer.text.prompts.chat_prompt`)."""
        return chat_prompt(self.tokenizer, messages, parse_special_in_content=parse_special_in_content)


def _parse_json(text: str, model: Any) -> Any:
    """The JSON in ``text``: a ``model`` instance (pydantic) when given; None when it does not parse."""
    import json

    try:
        return model.model_validate_json(text) if model is not None else json.loads(text)
    except ValueError:
        return None


__all__ = ["LLM", "GenerationResult", "Message", "Prompt", "SamplingOptions"]
