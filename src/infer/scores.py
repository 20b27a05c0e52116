"""Scores of given texts and the logit lens: what a loaded model thinks of each token.

`score`: each token's log-probability given the tokens before it, with the ``top_k`` most likely
alternatives; `logit_lens`: the logits each block's output would give through the final norm and
the head. Both run the model's plain eager forward (hooks and interventions run), the head on a few
hundred positions at a time, the log-softmax in float32. See docs/notebooks.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from infer.params import check_int

if TYPE_CHECKING:
    from infer.loader.tokenizer import Tokenizer
    from infer.models.base import DecoderLM

HEAD_ROWS = 256  # positions per call of the head (its logits are [rows, vocab] float32)
LENS_LIMIT_BYTES = 1 << 30  # a lens' logits past this are refused (ask fewer positions)
Progress = Callable[[Sequence[Any]], Any]  # wraps an iterable (tqdm.auto.tqdm)


class Scorable(Protocol):
    """What scoring needs of a loaded model (`infer.LLM` has it)."""

    tokenizer: Tokenizer
    model: DecoderLM

    def encode(self, prompt: str | list[int], what: str = "prompt") -> list[int]: ...


def token_texts(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's own text (special tokens spelled out)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


@dataclass
class TokenScores:
    """The scores of one text. ``token_ids`` / ``tokens``: all its tokens (BOS included when the
    tokenizer adds one); the first has no context and no score, so ``logprobs [n - 1]`` (float32)
    scores ``token_ids[1:]``, and ``top_ids`` / ``top_logprobs [n - 1, k]`` are the ``k`` most
    likely tokens at each of those positions, most likely first."""

    token_ids: list[int]
    tokens: list[str]
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    top_tokens: list[list[str]]

    @property
    def total(self) -> float:
        """The text's log-probability after its first token (the sum of ``logprobs``)."""
        return float(self.logprobs.double().sum())

    def rows(self) -> list[dict[str, Any]]:
        """One dict a scored token: ``token``, ``logprob``, ``rank`` (1: the top token; None: past
        ``k``) and ``top`` [(token, logprob)] — for a table (``pandas.DataFrame(s.rows())``)."""
        out = []
        for i, t in enumerate(self.token_ids[1:]):
            tops = self.top_ids[i].tolist()
            out.append({
                "token": self.tokens[i + 1],
                "logprob": float(self.logprobs[i]),
                "rank": tops.index(t) + 1 if t in tops else None,
                "top": list(zip(self.top_tokens[i], self.top_logprobs[i].tolist(), strict=True)),
            })  # fmt: skip
        return out

    def __repr__(self) -> str:
        return f"TokenScores({len(self.token_ids)} tokens, total logprob {self.total:.3f})"


def score(
    llm: Scorable,
    texts: str | list[int] | Sequence[str | list[int]],
    *,
    top_k: int = 5,
    batch_size: int = 8,
    progress: Progress | None = None,
) -> TokenScores | list[TokenScores]:
    """`TokenScores` of ``texts`` (a string or token ids: one result; a list of them: a list).
    ``batch_size`` texts go through one right-padded forward (causal: a text's positions are its
    own and never see the padding, so in the deterministic mode a text's scores are bitwise those
    of the text alone); ``progress`` wraps the batches."""
    top_k = check_int("top_k", top_k, 1)
    check_int("batch_size", batch_size, 1)
    one = isinstance(texts, str) or (isinstance(texts, list) and bool(texts) and isinstance(texts[0], int))
    items = cast("Sequence[str | list[int]]", [texts] if one else texts)
    if not isinstance(items, list | tuple) or not items:
        raise ValueError("texts: expected a string, a list of token ids, or a non-empty list of them")
    ids = [llm.encode(t, "text" if one else f"text {i}") for i, t in enumerate(items)]
    top_k = min(top_k, llm.model.vocab_size)
    batches = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
    out: list[TokenScores] = []
    for batch in progress(batches) if progress is not None else batches:
        out += _score_batch(llm, batch, top_k)
    return out[0] if one else out


@torch.inference_mode()
def _score_batch(llm: Scorable, batch: list[list[int]], top_k: int) -> list[TokenScores]:
    model, device = llm.model, llm.model.device
    T = max(len(t) for t in batch)
    ids = torch.tensor([t + [0] * (T - len(t)) for t in batch], device=device)  # [B, T], right-padded
    h = model.forward_hidden(ids, None, None)  # [B, T, D]
    out = []
    for b, tokens in enumerate(batch):
        n = len(tokens)
        rows = h[b, : n - 1]  # [n - 1, D]: the positions that predict tokens[1:]
        target = torch.tensor(tokens[1:], device=device)
        logprobs, top_ids, top_lp = [], [], []
        for start in range(0, n - 1, HEAD_ROWS):
            lp = torch.log_softmax(model.head(rows[None, start : start + HEAD_ROWS])[0].float(), dim=-1)
            logprobs.append(lp.gather(-1, target[start : start + HEAD_ROWS, None])[:, 0])
            top = lp.topk(top_k, dim=-1)
            top_ids.append(top.indices)
            top_lp.append(top.values)
        empty = torch.empty(0, top_k)
        tid = torch.cat(top_ids).cpu() if top_ids else empty.long()
        out.append(TokenScores(
            token_ids=list(tokens), tokens=token_texts(llm.tokenizer, tokens),
            logprobs=torch.cat(logprobs).cpu() if logprobs else torch.empty(0),
            top_ids=tid, top_logprobs=torch.cat(top_lp).cpu() if top_lp else empty,
            top_tokens=[token_texts(llm.tokenizer, r) for r in tid.tolist()],
        ))  # fmt: skip
    return out


@dataclass
class LogitLens:
    """The logit lens of one prompt: ``logits [layers + 1, P, V]`` (float32) at the ``positions``
    asked: row 0 from the embeddings, row ``i`` from block ``i - 1``'s output, each through the final
    norm and the head; the last row is the model's own logits."""

    token_ids: list[int]
    tokens: list[str]
    positions: list[int]
    logits: torch.Tensor

    def top(self, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, probabilities)``, each ``[layers + 1, P, k]``: each row's ``k`` likeliest tokens."""
        top = torch.softmax(self.logits, dim=-1).topk(k, dim=-1)
        return top.indices, top.values

    def probability(self, token_id: int) -> torch.Tensor:
        """``[layers + 1, P]``: the probability each layer gives ``token_id`` at each position."""
        return torch.softmax(self.logits, dim=-1)[..., token_id]

    def __repr__(self) -> str:
        L, P, V = self.logits.shape
        return f"LogitLens({L} rows (embeddings + {L - 1} blocks) x {P} positions x {V} vocab)"


@torch.inference_mode()
def logit_lens(
    llm: Scorable, prompt: str | list[int], positions: int | Sequence[int] | None = None
) -> LogitLens:
    """`LogitLens` of ``prompt`` at ``positions`` (an index or a list; negative from the end; None:
    every position). Memory: ``(layers + 1) x P x vocab x 4`` bytes (refused past 1 GiB)."""
    model = llm.model
    ids = llm.encode(prompt)
    T = len(ids)
    asked = range(T) if positions is None else [positions] if isinstance(positions, int) else positions
    chosen = []
    for p in asked:
        if isinstance(p, bool) or not isinstance(p, int) or not -T <= p < T:
            raise ValueError(f"positions: {p!r} is not a position of the prompt's {T} tokens")
        chosen.append(p % T)
    L = len(model.layers)
    size = (L + 1) * len(chosen) * model.vocab_size * 4
    if size > LENS_LIMIT_BYTES:
        raise ValueError(
            f"a logit lens of {len(chosen)} positions x {L + 1} layers x {model.vocab_size} tokens takes "
            f"{size / 2**30:.1f} GiB; ask fewer positions (positions=[-1], a list of a few)"
        )
    out = model(torch.tensor([ids], device=model.device), output_hidden_states=True)
    index = torch.tensor(chosen, device=model.device)
    rows = []
    for h in out.hidden_states[:-1]:  # before the last block's: not yet normed
        rows.append(model.head(h[:, index]).float()[0])  # [P, V]
    rows.append(out.logits[0, index].float())  # the last block's output through the norm and head
    return LogitLens(ids, token_texts(llm.tokenizer, ids), chosen, torch.stack(rows).cpu())


__all__ = ["LogitLens", "TokenScores", "logit_lens", "score", "token_texts"]
