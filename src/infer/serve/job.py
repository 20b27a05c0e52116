"""`Job`: one admitted request (its ``n`` choices), its metrics, and the response objects OpenAI's
clients read: a streamed chunk, the usage chunk, the whole response."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from infer.engine import Delta, TokenLogprob
from infer.serve.choices import Choice
from infer.serve.client import HandleClient
from infer.serve.echo import Echo
from infer.serve.logprobs import chat_logprobs, text_logprobs
from infer.serve.state import ServeState
from infer.text.prompts import ToolChat
from infer.text.tools import ToolCall


class Job:
    """One admitted request: its choices (``n`` engine requests), what they produced, its metrics."""

    def __init__(
        self,
        state: ServeState,
        kind: str,
        body: Any,
        handles: Sequence[HandleClient],
        arrived: float,
        chat: ToolChat | None = None,
        echoes: list[Echo] | None = None,
    ) -> None:
        self.state, self.kind, self.body, self.arrived = state, kind, body, arrived
        self.handles = list(handles)
        self.echoes = echoes  # completions' echo: choice i follows prompt i // n
        specials: dict[str, int] = {}
        if chat is not None and chat.format is not None:
            specials = state.model.tokenizer.special_tokens
        self.choices = [Choice(i, h, chat, specials) for i, h in enumerate(handles)]
        for c in self.choices:
            echo = self.echo(c)
            if echo is not None:
                c.text_offset = len(echo.text)
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.prompt_tokens = sum(h.prompt_tokens for h in self.handles[:: body.n])  # each prompt once
        self.completion_tokens = 0
        self.last_token_at: float | None = None
        self.outcome = "cancelled"

    def observe(self, delta: Delta) -> None:
        """Count ``delta``'s tokens (time to first token, gaps between tokens)."""
        n = len(delta.token_ids)
        if not n:
            return
        now = time.perf_counter()
        m = self.state.metrics
        if self.last_token_at is None:
            m.ttft.observe(now - self.arrived)
        else:
            gap = (now - self.last_token_at) / n
            for _ in range(n):
                m.inter_token.observe(gap)
        self.last_token_at = now
        self.completion_tokens += n
        m.generation_tokens.inc(n)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    def finish(self, outcome: str) -> None:
        self.outcome = outcome
        m = self.state.metrics
        m.requests.labels(endpoint=self.kind, outcome=outcome).inc()
        m.duration.observe(time.perf_counter() - self.arrived)

    # -- response objects --

    def echo(self, choice: Choice) -> Echo | None:
        """The echoed prompt before ``choice``'s text (None: no echo)."""
        return None if self.echoes is None else self.echoes[choice.index // self.body.n]

    def logprobs(self, choice: Choice, items: list[TokenLogprob] | None) -> Any:
        if items is None:
            return None
        tokenizer = self.state.model.tokenizer
        if self.kind == "chat":
            return {"content": chat_logprobs(tokenizer, items)}
        out, choice.text_offset = text_logprobs(tokenizer, items, choice.text_offset)
        return out

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }
        if self.kind == "chat":
            chunk["system_fingerprint"] = None
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            chunk["usage"] = None
        return chunk

    def chunk(
        self,
        choice: Choice,
        delta: Delta,
        content: str,
        reason: str | None,
        calls: list[ToolCall] | None = None,
    ) -> dict[str, Any]:
        """One streamed event of ``choice``: ``content`` (chat: the new text), its tokens' logprobs,
        ``calls`` (as ``delta.tool_calls``), ``reason`` on the last."""
        out: dict[str, Any] = {
            "index": choice.index,
            "logprobs": self.logprobs(choice, delta.logprobs),
            "finish_reason": reason,
        }
        if self.body.return_token_ids:
            out["token_ids"] = list(delta.token_ids)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant"} if choice.first else {}
            if content or choice.first:
                message["content"] = content
            if calls:
                message["tool_calls"] = [{"index": k, **c.openai()} for k, c in enumerate(calls)]
            out["delta"] = message
        else:
            out["text"] = content
        choice.first = False
        return self._envelope([out])

    def usage_chunk(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": [],
            "usage": self.usage(),
        }

    def whole(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            out: dict[str, Any] = {
                "index": c.index,
                "logprobs": self.logprobs(c, c.logprobs),
                "finish_reason": c.reason,
            }
            if self.body.return_token_ids:
                out["token_ids"] = c.token_ids
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": c.content}
                if c.calls:
                    message["content"] = c.content or None
                    message["tool_calls"] = [call.openai() for call in c.calls]
                out["message"] = message
            else:
                echo = self.echo(c)
                out["text"] = c.content if echo is None else echo.text + c.content
                if echo is not None:
                    out["logprobs"] = echo.before(out["logprobs"])
            choices.append(out)
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            "usage": self.usage(),
        }


__all__ = ["Job"]
