"""Checks a test runs on any `DecoderLM`, and the inputs they feed it."""

from __future__ import annotations

import torch

from infer.models.base import DecoderLM


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [B, T]`` left-padded with ``pad_id``, and the pad count per row ``[B]`` (for
    ``model.make_cache(..., pad=pad)``)."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    pad = torch.zeros(len(prompts), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p, dtype=torch.long)
        pad[b] = T - len(p)
    return ids, pad


def assert_cache_and_padding_match(model: DecoderLM, ids: torch.Tensor, prefill: int, pad: int) -> None:
    """Cached decoding (``prefill`` tokens, then one at a time) and ``pad`` tokens of left padding
    (on the first row) give the logits of the whole sequence ``ids [B, T]``."""
    T = ids.shape[1]
    with torch.no_grad():
        full = model(ids)
        cache = model.make_cache(ids.shape[0], T)
        first = model(ids[:, :prefill], cache=cache)
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(prefill, T)]
        padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids[:1]], dim=1)
        mask = torch.cat([torch.zeros(1, pad), torch.ones(1, T)], dim=1)
        left = model(padded, attention_mask=mask)[:, pad:]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(left, full[:1], atol=1e-4, rtol=1e-4)
