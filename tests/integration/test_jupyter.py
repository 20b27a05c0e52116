"""A Jupyter kernel as a home: the API inside a running event loop, the kernel's interrupt, the
display of an `LLM`, in a real IPython kernel (``jupyter_client``) where it matters."""

from __future__ import annotations

import asyncio
import os
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import infer

PROMPT = [5, 9, 200, 31, 7, 64, 12]


def test_the_api_works_inside_a_running_event_loop(tiny_ckpt_factory: Callable[..., Path]) -> None:
    """Jupyter runs each cell inside its asyncio loop: generate / stream / chat, inspection and
    scores called there (synchronously, as a cell calls them) give what they give outside."""
    llm = infer.load(tiny_ckpt_factory("llama"), compile=False)
    ids = torch.tensor([PROMPT])
    outside = (
        llm.generate(PROMPT, 12).token_ids,
        "".join(llm.stream(PROMPT, 12)),
        llm.chat([{"role": "user", "content": "hi"}], 8).text,
        llm.model(ids, output_attentions=True).attentions[1],
        llm.score(PROMPT).logprobs,
    )

    async def cell() -> tuple[Any, ...]:
        asyncio.get_running_loop()  # a loop runs, as in a notebook
        return (
            llm.generate(PROMPT, 12).token_ids,
            "".join(llm.stream(PROMPT, 12)),
            llm.chat([{"role": "user", "content": "hi"}], 8).text,
            llm.model(ids, output_attentions=True).attentions[1],
            llm.score(PROMPT).logprobs,
        )

    inside = asyncio.run(cell())
    assert inside[:3] == outside[:3]
    assert torch.equal(inside[3], outside[3]) and torch.equal(inside[4], outside[4])


def test_an_llm_describes_itself(tiny_ckpt_factory: Callable[..., Path]) -> None:
    llm = infer.load(tiny_ckpt_factory("llama"), compile=False)
    text, html = repr(llm), llm._repr_html_()
    print(f"\n{text}")
    for part in ("llama: 3 layers, hidden 64, heads 4 (kv 2), vocab 272", "parameters", "quantization none",
                 "K/V", "device cpu"):  # fmt: skip
        assert part in text
    facts = llm.summary()
    assert list(facts) == ["model", "architecture", "parameters", "quantization", "memory", "device"]
    assert html.startswith("<table>") and all(f">{k}</th>" in html and v in html for k, v in facts.items())
    params = sum(p.numel() for p in llm.model.parameters())
    assert f"{params / 1e6:.1f} M parameters" in text  # untied: every parameter once


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Any]:
    """A started IPython kernel (this interpreter, ``INFER_AOT=off``) and its client."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    env = {**os.environ, "INFER_AOT": "off", "OMP_NUM_THREADS": "1"}
    km.start_kernel(cwd=str(tmp_path), env=env)
    client = km.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        yield km, client
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


def _run(client: Any, code: str, timeout: float = 60) -> tuple[str, str | None]:
    """Execute ``code``; ``(stdout, the error's name or None)`` once the kernel is idle again."""
    msg_id = client.execute(code)
    out, error = [], None
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"the kernel did not finish {code!r}") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error":
            error = content["ename"]
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out), error


@pytest.mark.slow
@pytest.mark.parametrize("call", ["generate", "stream"])
def test_the_kernels_interrupt_ends_generation_and_frees_its_row(
    kernel: Any, tiny_ckpt_factory: Callable[..., Path], call: str
) -> None:
    """The stop button (SIGINT to the kernel) during a long generation: the cell ends with
    KeyboardInterrupt, the engine holds no running or waiting request, and the next generation
    gives what a fresh model gives (as the CLI's Ctrl-C: tests/integration/test_engine.py)."""
    km, client = kernel
    path = tiny_ckpt_factory("llama")
    setup = (
        "import time, infer\n"
        f"llm = infer.load({str(path)!r}, compile=False)\n"
        f"want = llm.generate({PROMPT}, 8).token_ids\n"
        "slow = llm.model.layers[0].register_forward_hook(lambda m, a, out: time.sleep(0.05))\n"
        "print('ready')"
    )
    assert _run(client, setup) == ("ready\n", None)
    long = (
        f"r = llm.generate({PROMPT}, 240)"
        if call == "generate"
        else f"for piece in llm.stream({PROMPT}, 240): print(piece, end='', flush=True)"
    )
    msg_id = client.execute(long)
    time.sleep(3.0)  # some 50 ms steps into it
    km.interrupt_kernel()
    error = None
    while True:
        msg = client.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            error = msg["content"]["ename"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert error == "KeyboardInterrupt"
    check = (
        "slow.remove()\n"
        "s = llm.engine.stats()\n"
        "print(s['running'], s['waiting'], llm.generate(" + str(PROMPT) + ", 8).token_ids == want)"
    )
    assert _run(client, check) == ("0 0 True\n", None)
