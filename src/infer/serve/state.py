"""`ServeState`: what an app holds (the engine, the model it serves as a description, limits,
metrics) and the requests it has running, which a shutdown drains and then ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer.engine import ServedModel
from infer.serve.client import EngineClient, HandleClient
from infer.serve.metrics import Metrics

if TYPE_CHECKING:
    from infer.serve.echo import PromptScorer


@dataclass
class ServeState:
    """What the app holds: the engine, the model it serves (its name, tokenizer, vocabulary,
    context), its limits and metrics, and what scores echoed prompts."""

    engine: EngineClient
    model: ServedModel
    model_name: str
    api_key: str | None
    context: int
    metrics: Metrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    handles: set[HandleClient] = field(default_factory=set)  # the requests running, of every response
    lock: threading.Lock = field(default_factory=threading.Lock)
    scorer: PromptScorer | None = None  # scores echoed prompts (`infer.serve.echo`); None: not here

    def admit(self, handles: Sequence[HandleClient]) -> None:
        """A response's requests run (one per choice)."""
        with self.lock:
            self.handles.update(handles)
        self.metrics.in_flight.inc()

    def release(self, handles: Sequence[HandleClient]) -> bool:
        """The response is over for its client: whether its requests were still held (the first
        release of them); the caller cancels them."""
        with self.lock:
            if not any(h in self.handles for h in handles):
                return False
            self.handles.difference_update(handles)
        self.metrics.in_flight.dec()
        return True

    def cancel_all(self) -> None:
        """End every request this app runs (the engine's others go on)."""
        with self.lock:
            running = list(self.handles)
        for handle in running:
            handle.cancel()

    def begin_shutdown(self, timeout: float) -> None:
        """Stop admitting; after ``timeout`` seconds cancel what still runs (streams get a final event)."""
        self.draining = True
        timer = threading.Timer(timeout, self.cancel_all)
        timer.daemon = True
        timer.start()


__all__ = ["ServeState"]
