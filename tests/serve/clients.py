"""What the server tests share of a client: the official `openai` client of a live server, and the
name it serves its model under."""

from __future__ import annotations

import httpx
import openai

TIMEOUT = httpx.Timeout(60.0)


def openai_client(base: str) -> openai.OpenAI:
    """The official client of the server at ``base`` (no retries: a failure shows as it is)."""
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60.0, max_retries=0)


def served_model(base: str) -> str:
    """The model name ``/v1/models`` lists first."""
    name: str = httpx.get(base + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
    return name
