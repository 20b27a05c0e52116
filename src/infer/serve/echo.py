"""Completions' ``echo``: the prompt returned before the generated text and, with ``logprobs``, its
tokens' scores as OpenAI's legacy completions and vLLM give them: ``tokens``, ``token_logprobs``
(the first null: nothing precedes it), ``top_logprobs`` (null, then the ``logprobs`` likeliest
tokens at each position) and ``text_offset``. ``max_tokens: 0`` with ``echo`` scores a text without
generating; lm-eval's ``local-completions`` scores answers with ``echo`` and ``max_tokens: 1``.

The prompt's scores come from one forward of the prompts (`infer.loglikelihood.score_rows`, the
in-process lm-eval backend's scoring, `infer.evaluation`), run beside the engine's loop on the same
weights. Only a model resident in the server's process can be scored so (`PromptScorer.of`):
elsewhere ``echo`` with ``logprobs`` is a 400 naming ``echo``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infer.loglikelihood import RowScores, score_rows
from infer.serve.logprobs import token_text

if TYPE_CHECKING:
    from infer.llm import LLM
    from infer.loader.tokenizer import Tokenizer
    from infer.models.base import DecoderLM

ROWS_PER_FORWARD = 16  # prompts scored in one forward


class PromptScorer:
    """Scores prompts on a server's model, one scoring forward at a time."""

    def __init__(self, model: DecoderLM) -> None:
        self.model = model
        self.lock = threading.Lock()

    @classmethod
    def of(cls, llm: LLM) -> PromptScorer | None:
        """A scorer for ``llm``'s model, or None where its forward cannot run beside the engine in
        this process (tensor/pipeline parallelism, layer streaming)."""
        if llm.parallel is not None or llm.streaming_stats is not None:
            return None
        return cls(llm.model)

    def __call__(self, prompts: list[list[int]], top: int) -> list[RowScores | None]:
        """Each prompt's scores of its tokens after the first (None for a one-token prompt)."""
        out: list[RowScores | None] = [None] * len(prompts)
        scored = [i for i, p in enumerate(prompts) if len(p) > 1]
        with self.lock:
            for s in range(0, len(scored), ROWS_PER_FORWARD):
                chunk = scored[s : s + ROWS_PER_FORWARD]
                for i, result in zip(
                    chunk, score_rows(self.model, [(prompts[i], 1) for i in chunk], top), strict=True
                ):
                    out[i] = result
        return out


@dataclass
class Echo:
    """A prompt as a response echoes it: its ``text`` and (with ``logprobs``) its tokens' entries in
    completions' format."""

    text: str
    logprobs: dict[str, Any] | None

    def before(self, logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
        """These entries followed by a choice's generated ones (None: no logprobs asked)."""
        if self.logprobs is None:
            return logprobs
        if logprobs is None:
            return dict(self.logprobs)
        return {k: self.logprobs[k] + logprobs[k] for k in self.logprobs}


def echo_of(
    tokenizer: Tokenizer, ids: list[int], text: str | None, scores: RowScores | None, logprobs: int | None
) -> Echo:
    """The `Echo` of a prompt (``text``: as sent, None for token ids: decoded); ``logprobs`` None:
    text only. Offsets count the tokens' own texts from 0."""
    shown = text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
    if logprobs is None:
        return Echo(shown, None)
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    values: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    if scores is not None:
        values += scores.logprobs.tolist()
        if scores.top_ids is not None and scores.top_logprobs is not None:
            for row_ids, row_lps in zip(scores.top_ids.tolist(), scores.top_logprobs.tolist(), strict=True):
                top: dict[str, float] = {}
                for i, v in zip(row_ids, row_lps, strict=True):
                    top.setdefault(token_text(tokenizer, i), v)  # tokens of one text: the likeliest's
                tops.append(top)
        else:
            tops += [{} for _ in range(len(ids) - 1)]
    entries = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
    return Echo(shown, entries)


__all__ = ["ROWS_PER_FORWARD", "Echo", "PromptScorer", "echo_of"]
