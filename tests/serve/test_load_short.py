"""The short version of benchmarks/serve_load.py: 40 requests with random prompt lengths and
``max_tokens``, streams that hang up mid-way, deliberately bad requests and a burst past the queue
(``max_batch=4, max_waiting=4``) against the tiny test checkpoint in the deterministic mode.

Checks (no timings): every completed response equals the same request served alone afterwards
(and that equals ``llm.generate`` in this process); a hung-up stream's tokens are a prefix of it;
every refused request got 429 with ``Retry-After`` (or 400 for a bad one) and nothing else;
``/metrics`` shows 0 running and 0 waiting at the end. The server runs in this process (a thread),
so its RSS is not checked here; the benchmark checks it on a server process of its own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

LiveServer = Callable[..., str]  # tests/serve/conftest.py's live_server
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


def _serve_load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_short_load(live_server: LiveServer, tiny_llm: Any) -> None:
    serve_load = _serve_load()
    base = live_server(tiny_llm, max_batch=4, max_waiting=4)
    report = asyncio.run(
        serve_load.run_load(
            base,
            requests=40,
            distinct=8,
            max_prompt=40,
            max_new=12,
            vocab=int(tiny_llm.config.vocab_size),
            concurrency=6,
            disconnect=0.25,
            burst=12,
            bad=2,
            seed=0,
            log=print,
        )
    )
    print(report.summary())
    assert not report.violations, "\n".join(report.violations)
    counts = report.counts()
    statuses = {o.status for o in report.outcomes}
    assert len(report.outcomes) == 40 + 12, counts
    assert statuses <= {200, 400, 429}, counts
    assert sum(o.status == 400 for o in report.outcomes) == 2, counts  # exactly the bad ones
    assert any(o.status == 200 and not o.disconnected for o in report.outcomes), counts
    # The served-alone answers are what the library gives in this process.
    assert report.alone
    for k, tokens in report.alone.items():
        if not tokens:  # the model ended at once (EOS): nothing to compare
            continue
        expected = tiny_llm.generate(report.prompts[k], max_new_tokens=len(tokens))
        assert expected.token_ids == tokens, f"prompt {k}: served {tokens}, llm.generate {expected.token_ids}"
