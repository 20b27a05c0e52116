"""Where llama.cpp's tools are: ``$LLAMA_CPP_BIN``, else the directory ``../shared/peers/llamacpp.sh``
prints (it builds them for this CPU the first time: 20-40 min; then it answers at once)."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

PEERS_SCRIPT = Path(__file__).resolve().parent.parent.parent / "shared" / "peers" / "llamacpp.sh"


@functools.cache
def llama_cpp_bin() -> Path | None:
    """The directory holding ``llama-bench``, ``llama-perplexity`` and ``llama-server``, or None when
    neither ``$LLAMA_CPP_BIN`` nor the peers script gives one."""
    given = os.environ.get("LLAMA_CPP_BIN")
    if given:
        return Path(given)
    if not PEERS_SCRIPT.is_file():
        return None
    out = subprocess.run(["bash", str(PEERS_SCRIPT)], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    return Path(lines[-1]) if out.returncode == 0 and lines else None


def llama_tool(name: str) -> Path:
    """The path of llama.cpp's ``name`` (may not exist: the caller says so)."""
    directory = llama_cpp_bin()
    return (directory or Path("llama.cpp-not-built")) / name
