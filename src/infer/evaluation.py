"""An lm-evaluation-harness model backend: lm-eval's tasks run on `infer` (docs/evaluation.md).

Importing this module registers the model name ``"infer"`` with lm-eval (0.4.13 discovers no
models from entry points), so ``lm_eval.simple_evaluate(model="infer",
model_args="pretrained=PATH,dtype=float32")`` works, and ``simple_evaluate(model=InferLM(llm))``
takes an `infer.LLM` already loaded. ``infer eval`` runs lm-eval's evaluator with it.

The requests are encoded, truncated and cut into windows exactly as lm-eval's ``hf`` backend does
(`lm_eval.api.model.TemplateLM`'s context/continuation split, ``_loglikelihood_tokens``' left
truncation to ``max_length + 1`` tokens, ``get_rolling_token_windows``), so the per-sample scores
are transformers' within the numerics contract (docs/numerics.md); what differs is how they are
computed: a batch of requests through one right-padded forward of infer's model, the head on the
continuation's positions only (`infer.loglikelihood.score_rows`), and generation through infer's
engine (continuous batching, ``until`` as stop strings).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from infer.loglikelihood import RowScores, score_rows
from infer.params import check_int

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from infer.llm import LLM

DEFAULT_BATCH = 16  # requests per forward (lm-eval's "auto" means this too)
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's default
# gen_kwargs infer honours (after lm-eval's `normalize_gen_kwargs`); any other is a ValueError.
GEN_KWARGS = frozenset({"do_sample", "temperature", "top_p", "top_k", "seed", "repetition_penalty"})
Request = tuple[Any, list[int], list[int]]  # (cache key, context ids, continuation ids)


def _batch_size(value: Any) -> int:
    """lm-eval's ``batch_size``: an int >= 1 (a digit string, as model_args may carry it), or
    "auto" / "auto:N" (`DEFAULT_BATCH`); a float or a bool is refused, not truncated."""
    if value is None or value == "auto" or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH
    n = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"batch_size: expected an int >= 1 or 'auto', got {value!r}")
    return n


@register_model("infer")
class InferLM(TemplateLM):  # type: ignore[misc]  # lm-eval ships no type information
    """lm-eval's `LM` over an `infer.LLM`: ``InferLM(llm)``, or ``InferLM("PATH_OR_NAME", dtype=...,
    deterministic=..., quantize=..., kv_dtype=...)`` which loads it with `infer.load` (what
    ``model_args="pretrained=...,dtype=..."`` gives). ``batch_size``: requests per forward (and
    prompts submitted together to the engine); ``max_length``: tokens of context at most (default:
    the model's positions, as the hf backend's); ``add_bos_token``: the hf backend's (None: the
    tokenizer's own choice)."""

    def __init__(
        self,
        pretrained: str | Path | LLM | None = None,
        *,
        dtype: str | None = None,
        deterministic: bool = False,
        quantize: str | None = None,
        kv_dtype: str | None = None,
        compile: bool | Literal["auto"] | None = None,
        device: str | None = None,
        batch_size: int | str | None = DEFAULT_BATCH,
        max_batch_size: int | None = None,  # lm-eval passes it; "auto" batch sizes are not searched
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
    ) -> None:
        super().__init__()
        from infer.api import check_bool
        from infer.llm import LLM

        if isinstance(pretrained, LLM):
            llm = pretrained
        elif isinstance(pretrained, str | Path):
            import infer

            check_bool("deterministic", deterministic)  # model_args' "deterministic=maybe" is a str
            llm = infer.load(
                pretrained, device=device or "cpu", dtype=None if dtype in (None, "auto") else dtype,
                quantize=quantize, deterministic=deterministic, kv_dtype=kv_dtype,
                compile=compile,
            )  # fmt: skip
        else:
            raise TypeError(f"InferLM: pretrained must be an infer.LLM or a path/name, got {pretrained!r}")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.batch = _batch_size(batch_size)
        positions = int(llm.config.max_position_embeddings)
        self._max_length = positions if max_length is None else check_int("max_length", max_length, 1)
        if not 1 <= self._max_length <= positions:
            raise ValueError(
                f"max_length: expected 1 .. {positions} (the model's positions), got {max_length}"
            )
        self._max_gen_toks = check_int("max_gen_toks", max_gen_toks, 1)
        self.add_bos_token = add_bos_token
        self._device = str(llm.model.device)

    # ---- what lm-eval asks of a model ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.hf.eos_token_id
        return int(eos) if eos is not None else self.tokenizer.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.source).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:  # fmt: skip
        """The hf backend's ``tok_encode``: the tokenizer's special tokens unless told, none when the
        string already starts with the prefix (BOS) token's text."""
        add = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        prefix = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
        if add_special_tokens is None and string.startswith(prefix):
            add = False
        ids = self.tokenizer.encode(string, add_special_tokens=True if add is None else add)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(
        self, requests: Sequence[Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(summed logprob, greedy)`` of each continuation: inputs ``(context + continuation)``
        truncated from the left to ``max_length + 1`` tokens (the hf backend's), the longest first,
        `batch` of them a forward."""
        L = self.max_length
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation or len(continuation) > L:
                raise ValueError(
                    f"request {i}: {len(context)} context and {len(continuation)} continuation tokens "
                    f"(expected at least one of each, and at most {L} continuation tokens)"
                )

        def length(req: Request) -> tuple[int, tuple[int, ...]]:
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        order = Collator(list(requests), sort_fn=length, group_by=None)
        out: list[tuple[float, bool]] = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for chunk in order.get_batched(n=self.batch):
            rows = []
            for _, context, continuation in chunk:
                tokens = (context + continuation)[-(L + 1) :]
                rows.append((tokens, len(tokens) - len(continuation)))
            for (key, _, _), scored in zip(chunk, self.score(rows), strict=True):
                answer = (scored.total, scored.greedy)
                out.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        result: list[tuple[float, bool]] = order.get_original(out)
        return result

    def score(self, rows: list[tuple[list[int], int]]) -> list[RowScores]:
        """One forward's scores of ``rows`` ``(tokens, start)`` (`infer.loglikelihood.score_rows`)."""
        return score_rows(self.llm.model, rows)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over the hf backend's windows (``get_rolling_token_windows``
        with ``max_length`` tokens and one of context; the first conditioned on the prefix token)."""
        windows: list[Request] = []
        counts = []
        for (text,) in [r.args for r in requests]:
            own = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]  # fmt: skip
            windows += [(None, context, predicted) for context, predicted in own]
            counts.append(len(own))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, at = [], 0
        for req, n in zip(requests, counts, strict=True):
            total = sum(s for s, _ in scores[at : at + n])
            at += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, generated by infer's engine (`batch` prompts submitted
        together) until a stop string of ``until``, an EOS token or ``max_gen_toks``; the context
        encoded and left-truncated to ``max_length - max_gen_toks`` as the hf backend does, the text
        cut at the first stop string as it does."""
        order = Collator(
            [r.args for r in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs", group_fn=lambda r: r[1],
        )  # fmt: skip
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out: list[str] = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for chunk in order.get_batched(n=self.batch):
            contexts = [c for c, _ in chunk]
            kwargs = normalize_gen_kwargs(dict(chunk[0][1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = check_int("max_gen_toks", kwargs.pop("max_gen_toks"), 1)
            room = self.max_length - max_new
            if room < 1:
                raise ValueError(
                    f"max_gen_toks is {max_new}: no room for a context in max_length {self.max_length}"
                )
            ids = [self._context_ids(c, contexts[0], room) for c in contexts]
            sampling = self._sampling(kwargs)
            stops = [s for s in until if s][:16]
            # A seed is each request's: the prompts of one call draw row seeds derived from it
            # (`SamplingParams.row`), so seeded requests go one a call and draw as alone, at any
            # batch size and place in it.
            calls = [[i] for i in range(len(ids))] if "seed" in sampling else [list(range(len(ids)))]
            results = [
                r
                for call in calls
                for r in self.llm.generate(
                    [ids[i] for i in call], max_new_tokens=max_new, stop=stops or None, **sampling
                )
            ]
            for (context, gen_kwargs), result in zip(chunk, results, strict=True):
                text = self.tok_decode(result.token_ids)
                text = postprocess_generated_text(text, until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                bar.update(1)
        bar.close()
        result_texts: list[str] = order.get_original(out)
        return result_texts

    def _context_ids(self, context: str, first: str, room: int) -> list[int]:
        """The hf backend's ``tok_batch_encode`` of one context: no special tokens when the batch's
        first context starts with the BOS token's text, else ``add_bos_token`` or the tokenizer's."""
        bos = self.tokenizer.bos_token_id
        bos_text = None if bos is None else self.tokenizer.decode([bos], skip_special_tokens=False)
        if bos_text is not None and first.startswith(bos_text):
            add = False
        else:
            add = True if self.add_bos_token is None else self.add_bos_token
        return self.tokenizer.encode(context, add_special_tokens=add)[-room:]

    @staticmethod
    def _sampling(kwargs: dict[str, Any]) -> dict[str, Any]:
        """infer's sampling keywords for lm-eval's normalized gen_kwargs (greedy unless do_sample)."""
        unknown = sorted(set(kwargs) - GEN_KWARGS)
        if unknown:
            raise ValueError(
                f"gen_kwargs: {', '.join(unknown)} not supported by the infer backend "
                f"(it takes {', '.join(sorted(GEN_KWARGS))}, until and max_gen_toks)"
            )
        if not kwargs.get("do_sample"):
            return {"temperature": 0.0}
        out: dict[str, Any] = {"temperature": float(kwargs.get("temperature", 1.0))}
        for name in ("top_p", "top_k", "seed", "repetition_penalty"):
            if kwargs.get(name) is not None:
                out[name] = kwargs[name]
        return out

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat as text, rendered by transformers' tokenizer as the hf backend renders it."""
        from infer.loader.tokenizer import FastTokenizer

        hf = self.tokenizer.hf
        if isinstance(hf, FastTokenizer):
            hf = hf.transformers()
        text: str = hf.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )  # fmt: skip
        return text


__all__ = ["DEFAULT_BATCH", "InferLM"]
