"""Perplexity of a model over a text, computed the way llama.cpp's ``llama-perplexity -c N -b N`` does.

Chunks of ``N`` tokens run as fresh sequences and the second half of each is scored; ``ppl =
exp(mean NLL)`` with llama.cpp's ``+/-``. Only the scored half goes through the head, and the
log-sum-exp runs over a few rows at a time. The recipe and measurements: docs/numerics.md,
"Perplexity".
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch

from infer.params import check_int

if TYPE_CHECKING:
    from infer.loader.config import ModelConfig
    from infer.loader.tokenizer import Tokenizer
    from infer.models.base import DecoderLM


class LLM(Protocol):
    """What perplexity needs of a loaded model (`infer.api.LLM`, which calls this module, has it)."""

    config: ModelConfig
    tokenizer: Tokenizer
    model: DecoderLM


ProgressFn = Callable[[int, int, float], None]  # (chunks done, chunks in all, perplexity so far)


class PerplexityOptions(TypedDict, total=False):
    """`perplexity`'s keywords, typed for a caller that passes them on (`infer.api.LLM.perplexity`)."""

    batch: int
    max_chunks: int | None
    progress: ProgressFn | None


MIN_CONTEXT = 3  # one token of context (after BOS) and one scored token
DEFAULT_CONTEXT = 512
ROWS_PER_SOFTMAX = 64  # log-sum-exp over this many positions at a time (float64)


@dataclass(frozen=True)
class PerplexityResult:
    """``ppl = exp(nll)``; ``nll`` is the mean negative log-likelihood (nats) of the ``tokens``
    scored tokens; ``ppl_error`` is llama.cpp's ``+/-`` (standard error of ``nll`` times ``ppl``).
    ``text_tokens``: tokens in the whole text (BOS included); ``chunks`` of ``context`` tokens
    were run; ``add_bos``: whether each chunk started with the BOS token."""

    ppl: float
    nll: float
    ppl_error: float
    tokens: int
    chunks: int
    context: int
    text_tokens: int
    add_bos: bool

    def __str__(self) -> str:
        return (
            f"PPL = {self.ppl:.4f} +/- {self.ppl_error:.5f} (mean NLL {self.nll:.6f} over "
            f"{self.tokens:,} tokens in {self.chunks} chunks of {self.context}; "
            f"the text has {self.text_tokens:,} tokens)"
        )


def read_text(path: str | os.PathLike[str], max_bytes: int | None = None) -> str:
    """The UTF-8 text of ``path`` as ``llama-perplexity -f`` reads it: at most ``max_bytes`` bytes
    (an incomplete character at the cut is dropped), one trailing newline removed."""
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, 1)
    p = Path(path)
    with p.open("rb") as f:
        data = f.read() if max_bytes is None else f.read(max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        # A cut through a multi-byte character leaves an incomplete one at the very end.
        if max_bytes is not None and e.reason == "unexpected end of data" and e.end == len(data):
            text = data[: e.start].decode("utf-8")
        else:
            raise ValueError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return text[:-1] if text.endswith("\n") else text


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts the BOS token in front of an encoded text (llama.cpp's
    ``add_bos``): compares an encoding with and without special tokens."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special: list[int] = tokenizer.encode("a", add_special_tokens=True)
    plain: list[int] = tokenizer.encode("a", add_special_tokens=False)
    return with_special[:1] == [bos] and plain[:1] != [bos]


def tokenize(llm: LLM, text: str) -> tuple[list[int], bool]:
    """``(token ids, add_bos)``: the whole text as llama.cpp's perplexity tokenizes it (special-token
    spellings encoded as text, BOS in front when the tokenizer adds one)."""
    add_bos = adds_bos(llm.tokenizer)
    ids: list[int] = llm.tokenizer.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
    if add_bos:
        bos = llm.tokenizer.bos_token_id
        assert bos is not None
        ids = [bos, *ids]
    return ids, add_bos


def _scored_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``-log softmax(logits)[target]`` per row of ``logits [R, V]`` (float64, a few rows at a time)."""
    out = []
    for r in range(0, logits.shape[0], ROWS_PER_SOFTMAX):
        rows = logits[r : r + ROWS_PER_SOFTMAX].double()
        tgt = targets[r : r + ROWS_PER_SOFTMAX]
        out.append(torch.logsumexp(rows, dim=-1) - rows.gather(1, tgt[:, None])[:, 0])
    return torch.cat(out)


def perplexity(
    llm: LLM,
    text: str,
    context: int = DEFAULT_CONTEXT,
    *,
    batch: int = 1,
    max_chunks: int | None = None,
    progress: ProgressFn | None = None,
) -> PerplexityResult:
    """Perplexity of ``llm`` over ``text`` as ``llama-perplexity -c context -b context`` computes it.

    ``context`` (N): tokens per chunk, at least 3 and at most the model's positions; the text
    must tokenize to at least ``2 N`` tokens. The second half of each chunk is scored
    (docs/numerics.md). ``batch``: chunks run together in one forward pass (>= 1; more is faster
    and takes ``batch`` times the memory). ``max_chunks``: score only the first ones (>= 1; None:
    all). ``progress(done, total, ppl_so_far)`` is called after each batch of chunks.

    The model runs its plain forward (no KV cache, the eager path whatever ``compile`` was),
    or, when its KV cache holds another dtype than its activations (``infer.load(...,
    kv_dtype=...)``), each chunk's forward through a KV cache of that dtype: the keys and values
    attention reads are then the rounded ones generation reads, and the figure shows their cost.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if not text:
        raise ValueError("text is empty (an empty string)")
    limit = llm.config.max_position_embeddings
    context = check_int("context", context, MIN_CONTEXT, limit)
    batch = check_int("batch", batch, 1)
    if max_chunks is not None:
        max_chunks = check_int("max_chunks", max_chunks, 1)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable, got {type(progress).__name__}")

    tokens, add_bos = tokenize(llm, text)
    if len(tokens) < 2 * context:
        raise ValueError(
            f"the text tokenizes to {len(tokens):,} tokens; a context of {context} needs at least "
            f"{2 * context:,} (two chunks): give a longer text or a smaller context"
        )
    n_chunks = len(tokens) // context
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    first = context // 2
    bos = llm.tokenizer.bos_token_id if add_bos else None
    model = llm.model
    all_ids = torch.tensor(tokens[: n_chunks * context], dtype=torch.long).view(n_chunks, context)
    nll_sum = nll2_sum = 0.0
    count = 0
    with torch.inference_mode():
        for start in range(0, n_chunks, batch):
            ids = all_ids[start : start + batch].clone()
            if bos is not None:
                ids[:, 0] = bos
            ids = ids.to(model.device)
            cache = model.make_cache(ids.shape[0], context) if model.cache_dtype != model.dtype else None
            hidden = model.forward_hidden(ids, cache)
            logits = model.head(hidden[:, first : context - 1])  # [b, context - 1 - first, V]
            targets = ids[:, first + 1 :]
            nll = _scored_nll(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            nll_sum += float(nll.sum())
            nll2_sum += float((nll * nll).sum())
            count += nll.numel()
            if progress is not None:
                progress(min(start + batch, n_chunks), n_chunks, math.exp(nll_sum / count))
    mean = nll_sum / count
    ppl = math.exp(mean)
    var = nll2_sum / count - mean * mean
    error = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return PerplexityResult(
        ppl=ppl,
        nll=mean,
        ppl_error=error,
        tokens=count,
        chunks=n_chunks,
        context=context,
        text_tokens=len(tokens),
        add_bos=add_bos,
    )


__all__ = [
    "DEFAULT_CONTEXT",
    "PerplexityOptions",
    "PerplexityResult",
    "adds_bos",
    "perplexity",
    "read_text",
    "tokenize",
]
