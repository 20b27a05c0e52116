"""Log-likelihoods of token sequences, many per forward: what lm-eval's backend (`infer.evaluation`)
and the server's ``echo`` (`infer.serve.echo`) score.

A batch of rows ``(tokens, start)`` runs as one right-padded forward of ``tokens[:-1]`` (the model's
plain eager forward, no KV cache, as `infer.scores`); each row's scored positions are its own
(``start - 1 .. len - 2``, predicting ``tokens[start:]``), so padding never reaches them (causal
attention). The final norm and head run on the scored positions only, a few hundred at a time, and
the log-softmax is float32 over the full vocabulary — lm-eval's hf backend's recipe
(``_loglikelihood_tokens``: right padding, ``log_softmax`` of the logits, continuation gathered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infer.models.base import DecoderLM

HEAD_ROWS = 256  # scored positions per call of the head (its logits are [rows, vocab] float32)


@dataclass
class RowScores:
    """The scores of ``tokens[start:]`` of one row: ``logprobs [n]`` (float32), ``greedy`` (whether
    every one is its position's argmax), and, when asked, the ``top_ids`` / ``top_logprobs [n, k]``
    most likely tokens at each position (most likely first)."""

    logprobs: torch.Tensor
    greedy: bool
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    @property
    def total(self) -> float:
        """The summed log-probability (float64 sum)."""
        return float(self.logprobs.double().sum())


def check_rows(rows: Sequence[tuple[Sequence[int], int]], limit: int) -> None:
    """`ValueError` naming the row for a start outside ``1 .. len(tokens) - 1`` or an input longer
    than the model's ``limit`` positions."""
    for i, (tokens, start) in enumerate(rows):
        if not 1 <= start < len(tokens):
            raise ValueError(
                f"row {i}: scores tokens[{start}:] of {len(tokens)} tokens; expected 1 <= start < len"
            )
        if len(tokens) - 1 > limit:
            raise ValueError(
                f"row {i}: {len(tokens)} tokens need {len(tokens) - 1} positions; the model has {limit}"
            )


@torch.inference_mode()
def score_rows(
    model: DecoderLM, rows: Sequence[tuple[Sequence[int], int]], top_k: int = 0
) -> list[RowScores]:
    """`RowScores` of each row ``(tokens, start)`` (``1 <= start < len(tokens)``), all in one forward."""
    if not rows:
        return []
    check_rows(rows, model.config.max_position_embeddings)
    device = model.device
    T = max(len(t) - 1 for t, _ in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)  # [B, T], right-padded with id 0
    for b, (tokens, _) in enumerate(rows):
        ids[b, : len(tokens) - 1] = torch.tensor(list(tokens[:-1]))
    h = model.forward_hidden(ids.to(device), None, None)  # [B, T, D]
    picked = torch.cat(
        [h[b, start - 1 : len(tokens) - 1] for b, (tokens, start) in enumerate(rows)]
    )  # [R, D]
    target = torch.tensor([t for tokens, start in rows for t in tokens[start:]], device=device)  # [R]
    logprobs, argmax, top_ids, top_lp = [], [], [], []
    for s in range(0, picked.shape[0], HEAD_ROWS):
        lp = torch.log_softmax(model.head(picked[None, s : s + HEAD_ROWS])[0].float(), dim=-1)  # [r, V]
        logprobs.append(lp.gather(-1, target[s : s + HEAD_ROWS, None])[:, 0])
        argmax.append(lp.argmax(dim=-1))
        if top_k:
            top = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
            top_ids.append(top.indices)
            top_lp.append(top.values)
    all_lp = torch.cat(logprobs).cpu()
    hits = (torch.cat(argmax) == target).cpu()
    tids = torch.cat(top_ids).cpu() if top_k else None
    tlps = torch.cat(top_lp).cpu() if top_k else None
    out, at = [], 0
    for tokens, start in rows:
        n = len(tokens) - start
        out.append(RowScores(
            all_lp[at : at + n], bool(hits[at : at + n].all()),
            None if tids is None else tids[at : at + n], None if tlps is None else tlps[at : at + n],
        ))  # fmt: skip
        at += n
    return out


__all__ = ["HEAD_ROWS", "RowScores", "check_rows", "score_rows"]
