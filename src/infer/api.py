"""The public API: `load` a checkpoint, get an `LLM`, generate text."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch

from infer.generate import RowState, SamplingParams, generate_steps, run_to_end
from infer.loader.config import ModelConfig, load_config
from infer.loader.tokenizer import Tokenizer
from infer.models import model_class
from infer.models.base import DecoderLM
from infer.models.common import fuse_projections
from infer.step import Stepper

if TYPE_CHECKING:
    from infer.streaming import StreamingConfig

Prompt = str | list[int]
ProgressFn = Callable[[int, int], None]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@dataclass
class GenerationResult:
    """The generated part of one prompt.

    ``token_ids`` ends with the EOS id when generation stopped on one;
    ``text`` is the decoded generation without special tokens, cut before a stop string.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "stop" or "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def __str__(self) -> str:
        return self.text


def resolve_dtype(dtype: torch.dtype | str | None, default: str | None = None) -> torch.dtype:
    """``dtype`` as a torch dtype; ``None`` means ``default`` (the checkpoint's), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype is not None else default
    if name is None:
        return torch.float32
    name = str(name).removeprefix("torch.")
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def resolve_checkpoint(path_or_hub_id: str | os.PathLike[str]) -> Path:
    """A local directory or .gguf file, or a hub id found in the local HF cache (or downloaded)."""
    path = Path(path_or_hub_id).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
            raise FileNotFoundError(f"{path} has no config.json: not a HuggingFace checkpoint directory")
        return path
    hub_id = str(path_or_hub_id)
    if hub_id.count("/") != 1 or hub_id.startswith((".", "/", "~")):
        raise FileNotFoundError(f"no such file or directory: {hub_id}")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # not in the local cache: try the network below
        pass
    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(
            f"model {hub_id!r} is not on disk and could not be downloaded ({type(e).__name__}). "
            f"On a machine with internet run `huggingface-cli download {hub_id}` (or pass a local "
            f"directory with config.json + *.safetensors)."
        ) from None


class TextStream:
    """Turns a growing list of token ids into text pieces, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens)

    def push(self, tokens: list[int], hold: int = 0) -> str:
        """Replace the tokens and return the new safe text, keeping back the last ``hold`` characters."""
        self.tokens = tokens
        full = self.text()
        if full.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            full = full.rstrip("\ufffd")
        safe = full[: max(len(self.emitted), len(full) - hold)]
        piece = safe[len(self.emitted) :] if safe.startswith(self.emitted) else ""
        self.emitted += piece
        return piece


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class LLM:
    """A loaded model with its tokenizer: `generate`, `stream`, `chat`."""

    def __init__(
        self,
        config: ModelConfig,
        tokenizer: Tokenizer,
        model: DecoderLM,
        source: Path,
        *,
        compile: bool = False,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        self.source = source
        self.stepper = Stepper(model, compile=compile)

    @property
    def compiled(self) -> bool:
        """Whether generation runs the compiled step (`infer.step.Stepper`)."""
        return self.stepper.compiled

    def __repr__(self) -> str:
        m = self.model
        return f"LLM({self.config.model_type}, {self.source}, dtype={m.dtype}, device={m.device})"

    @property
    def streaming_stats(self) -> Any:
        """Layer-streaming statistics (None when the model is resident)."""
        return getattr(self.model.executor, "stats", None)

    # ---- prompts --------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        return ids

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
    ) -> Iterator[list[RowState]]:
        def stop_check(row: int, tokens: list[int]) -> bool:
            return _cut_at_stop(self.tokenizer.decode(tokens), stop)[1]

        eos_ids = self._eos_ids()
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = eos_ids[0] if eos_ids else 0
        self._timings: dict[str, float] = {}
        yield from generate_steps(
            self.model,
            prompts,
            max_new_tokens=max_new_tokens,
            params=params,
            eos_ids=eos_ids,
            pad_id=pad_id,
            stop_check=stop_check if stop else None,
            timings=self._timings,
            stepper=self.stepper,
        )

    def _result(self, row: RowState, stop: Sequence[str]) -> GenerationResult:
        text, _ = _cut_at_stop(self.tokenizer.decode(row.tokens), stop)
        return GenerationResult(
            text=text,
            token_ids=list(row.tokens),
            prompt_tokens=row.prompt_len,
            finish_reason=row.finish_reason or "length",
            prefill_seconds=self._timings.get("prefill_s", 0.0),
            decode_seconds=self._timings.get("decode_s", 0.0),
        )

    # ---- public ---------------------------------------------------------------

    @overload
    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = ...,
        *,
        temperature: float = ...,
        top_k: int = ...,
        top_p: float = ...,
        seed: int | None = ...,
        stop: str | Sequence[str] | None = ...,
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        prompt: list[str] | list[list[int]],
        max_new_tokens: int = ...,
        *,
        temperature: float = ...,
        top_k: int = ...,
        top_p: float = ...,
        seed: int | None = ...,
        stop: str | Sequence[str] | None = ...,
    ) -> list[GenerationResult]: ...

    def generate(
        self,
        prompt: Prompt | list[str] | list[list[int]],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate a continuation of ``prompt``.

        ``prompt`` is a string, a list of token ids, or a list of either (a batch,
        run as one padded batch; returns a list). ``temperature=0`` is greedy; with
        ``temperature > 0`` sampling uses ``top_k`` / ``top_p`` and ``seed`` makes it
        reproducible. Generation stops at any EOS id of the model, at any of the
        ``stop`` strings, or after ``max_new_tokens``.
        """
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt is empty")
        prompts_in: list[Prompt] = list(prompt) if batch else [prompt]  # type: ignore[list-item, arg-type]
        prompts = [self._encode(p) for p in prompts_in]
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        params = SamplingParams(temperature, top_k, top_p, seed)
        rows = run_to_end(self._run(prompts, max_new_tokens, params, stops))
        results = [self._result(r, stops) for r in rows]
        return results if batch else results[0]

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[str]:
        """Like `generate` for one prompt, yielding text pieces as they are decoded."""
        ids = self._encode(prompt)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        params = SamplingParams(temperature, top_k, top_p, seed)
        out = TextStream(self.tokenizer)
        hold = max((len(s) for s in stops), default=1) - 1  # a stop string may be forming
        last: RowState | None = None
        for rows in self._run([ids], max_new_tokens, params, stops):
            last = rows[0]
            if last.finish_reason is None:
                piece = out.push(last.tokens, hold)
                if piece:
                    yield piece
        if last is not None:
            final = self._result(last, stops).text
            if final.startswith(out.emitted) and len(final) > len(out.emitted):
                yield final[len(out.emitted) :]

    def chat(
        self,
        messages: list[dict[str, str]],
        max_new_tokens: int = 256,
        **kwargs: Any,
    ) -> GenerationResult:
        """Apply the tokenizer's chat template to ``messages`` and generate the assistant's reply."""
        ids = self.chat_prompt(messages)
        result: GenerationResult = self.generate(ids, max_new_tokens, **kwargs)
        return result

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if not messages:
            raise ValueError("messages is empty")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template writes the BOS token itself; don't add another one.
        return self.tokenizer.encode(text, add_special_tokens=False)


def load(
    path_or_hub_id: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    quantize: str | None = None,
    streaming: StreamingConfig | None = None,
    progress: ProgressFn | None = None,
    compile: bool | None = None,
) -> LLM:
    """Load a checkpoint and its tokenizer into an `LLM`.

    ``path_or_hub_id``: a directory with ``config.json`` + safetensors (+ tokenizer
    files), a ``.gguf`` file, or a hub id already in the local HF cache (or
    downloadable). ``dtype`` defaults to the checkpoint's. ``quantize`` ("q4_0" or
    "int8") quantizes the weight matrices of a safetensors checkpoint at load time.
    ``streaming`` runs the layers through the device under a memory budget instead
    of keeping them resident. ``progress(done, total)`` is called as tensors load.
    ``compile`` runs generation through ``torch.compile`` of the whole step (resident
    models only; `infer.step`): the first request of each new (batch, length) bucket
    compiles it (cached on disk under the user's cache directory, so later processes
    load it). ``None`` means `compile_by_default` (off: a short generation does not win
    back even a warm compile).
    """
    device = torch.device(device)
    if compile and streaming is not None:
        raise ValueError("compile=True applies to resident models; a streamed model runs eagerly")
    use_compile = compile_by_default(device) if compile is None else compile
    use_compile = use_compile and streaming is None
    path = resolve_checkpoint(path_or_hub_id)
    if path.suffix == ".gguf":
        llm = _load_gguf(path, device, dtype, quantize=quantize, streaming=streaming, progress=progress)
        if streaming is None:
            fuse_projections(llm.model)
        if use_compile:
            llm.stepper = Stepper(llm.model, compile=True)
        return llm
    config = load_config(path)
    torch_dtype = resolve_dtype(dtype, config.torch_dtype)
    tokenizer = Tokenizer(path, eos_token_id=config.eos_token_id)
    cls = model_class(config)
    model: torch.nn.Module
    if streaming is not None:
        from infer.streaming import build_streaming_model

        model = build_streaming_model(
            path, config, cls, device=device, dtype=torch_dtype, streaming=streaming, quantize=quantize
        )
    else:
        from infer.loader.build import load_safetensors_model

        model = load_safetensors_model(
            path, config, cls, dtype=torch_dtype, device=device, progress=progress, quantize=quantize
        )
    if not isinstance(model, DecoderLM):
        raise TypeError(f"model builder returned {type(model).__name__}, expected a DecoderLM")
    if streaming is None:
        fuse_projections(model)  # q/k/v and gate/up as one product each
    return LLM(config, tokenizer, model, path, compile=use_compile)


def compile_by_default(device: torch.device) -> bool:
    """Whether `load` compiles when ``compile`` is not given: off on every device.

    On this project's CPU benchmark (docs/performance.md, *Compiled step*) a compiled step
    saves ~15 ms a token on SmolLM2 but a warm compile takes ~10 s, so a short generation
    (128 tokens) does not win it back; on CUDA it is not measured here. Pass
    ``compile=True`` (``--compile``) for long or repeated generations in one process.
    """
    del device
    return False


def _load_gguf(
    path: Path,
    device: torch.device,
    dtype: torch.dtype | str | None,
    *,
    quantize: str | None,
    streaming: StreamingConfig | None,
    progress: ProgressFn | None,
) -> LLM:
    from infer.gguf import load_gguf

    if quantize is not None:
        raise ValueError(
            f"{path}: quantize= applies to safetensors checkpoints; a GGUF file is already quantized"
        )
    torch_dtype = None if dtype is None else resolve_dtype(dtype)
    if streaming is not None:
        from infer.streaming import build_streaming_model_gguf

        config, model, tokenizer = build_streaming_model_gguf(
            path, device=device, dtype=torch_dtype, streaming=streaming
        )
    else:
        config, model, tokenizer = load_gguf(path, device=device, dtype=torch_dtype, progress=progress)
    if not isinstance(model, DecoderLM):
        raise TypeError(f"GGUF loader returned {type(model).__name__}, expected a DecoderLM")
    return LLM(config, tokenizer, model, path)
