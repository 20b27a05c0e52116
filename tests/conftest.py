"""Shared fixtures: tiny checkpoints built locally, so nothing skips offline.

Fixtures (all tiny checkpoints come from `infer.testing.build_checkpoint`, i.e. real
transformers models saved with ``save_pretrained``, with a byte-level tokenizer and a
``generation_config.json`` listing two EOS ids):

* ``tiny_ckpt_factory`` (session): ``make(arch, sharded=False, dtype=torch.float32) -> Path``,
  one directory per ``(arch, sharded, dtype)``, built once per session and cached.
  ``arch`` is one of ``ARCHS`` (``"llama"``, ``"qwen3"``, ``"gemma3"``).
* ``arch``: parametrized over ``ARCHS`` (override with ``@pytest.mark.parametrize("arch", ...)``).
* ``sharded``: parametrized over ``[False, True]`` (single ``model.safetensors`` / index + shards).
* ``tiny_checkpoint``: ``tiny_ckpt_factory(arch, sharded)`` at float32.
* ``hf_model_factory`` (session): ``load(path, dtype=torch.float32) -> transformers model``
  (``AutoModelForCausalLM``, eager attention, eval mode), cached per ``(path, dtype)``.
  Treat the returned model as read-only: it is shared.
* ``our_model_factory`` (session): ``load(path, dtype=torch.float32) -> DecoderLM`` built with
  our loader (`infer.assembly.build.load_model`), cached per ``(path, dtype)``;
  read-only as well (build a fresh cache per test with ``model.make_cache``).
* ``tokenizer_dir`` (session): a directory holding only the tiny tokenizer files
  (no ``generation_config.json``).
* ``reap_processes``: a function listing the live processes whose command line names this
  test's ``tmp_path`` (the package builders and workers a test starts there); every one
  left is killed at teardown, so no test leaves a process behind.
* ``dev_configs``: fresh deep copies of the real hub ``config.json`` dicts of the dev models,
  keyed ``"llama"`` (Llama-3.2-1B-Instruct), ``"qwen3"`` (Qwen3-1.7B), ``"gemma3"`` (gemma-3-1b-it).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ARCHS = ("llama", "qwen3", "gemma3")

# No test uses or builds ahead-of-time compiled packages of its tiny models unless it asks to
# (tests/integration/test_aot.py): not this process, not the `infer` processes tests start.
os.environ["INFER_AOT"] = "off"
# Product routes measured by the suite's processes go to a directory of the run's own, never the
# user's table (`infer.quant.routes`): either route is exact, so no test depends on which is picked.
if "INFER_ROUTES_DIR" not in os.environ:
    os.environ["INFER_ROUTES_DIR"] = tempfile.mkdtemp(prefix="infer-test-routes-")
    atexit.register(shutil.rmtree, os.environ["INFER_ROUTES_DIR"], True)

# Values of the hub config.json files of the dev models (as published on the Hub).
LLAMA_3_2_1B_INSTRUCT: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

QWEN3_1_7B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

GEMMA_3_1B_IT: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}

DEV_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": LLAMA_3_2_1B_INSTRUCT,
    "qwen3": QWEN3_1_7B,
    "gemma3": GEMMA_3_1B_IT,
}


@pytest.fixture
def dev_configs() -> dict[str, dict[str, Any]]:
    return copy.deepcopy(DEV_CONFIGS)


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["single", "sharded"])
def sharded(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


CkptFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_ckpt_factory(tmp_path_factory: pytest.TempPathFactory) -> CkptFactory:
    from infer.testing import ARCHITECTURES, build_checkpoint

    built: dict[tuple[str, bool, torch.dtype], Path] = {}

    def make(arch: str, sharded: bool = False, dtype: torch.dtype = torch.float32) -> Path:
        if arch not in ARCHITECTURES:
            raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")
        key = (arch, sharded, dtype)
        if key not in built:
            name = f"{arch}-{'sharded' if sharded else 'single'}-{str(dtype).removeprefix('torch.')}"
            built[key] = build_checkpoint(tmp_path_factory.mktemp(name), arch, sharded=sharded, dtype=dtype)
        return built[key]

    return make


@pytest.fixture
def tiny_checkpoint(tiny_ckpt_factory: CkptFactory, arch: str, sharded: bool) -> Path:
    return tiny_ckpt_factory(arch, sharded)


def _cached_per_checkpoint(build: Callable[[Path, torch.dtype], Any]) -> Callable[..., Any]:
    """``load(path, dtype=torch.float32)``: ``build(path, dtype)`` once per ``(path, dtype)``, then shared."""
    cache: dict[tuple[Path, torch.dtype], Any] = {}

    def load(path: Path, dtype: torch.dtype = torch.float32) -> Any:
        key = (Path(path), dtype)
        if key not in cache:
            cache[key] = build(Path(path), dtype)
        return cache[key]

    return load


@pytest.fixture(scope="session")
def hf_model_factory() -> Callable[..., Any]:
    def build(path: Path, dtype: torch.dtype) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")
        return model.eval()  # type: ignore[no-untyped-call]

    return _cached_per_checkpoint(build)


@pytest.fixture(scope="session")
def our_model_factory() -> Callable[..., Any]:
    from infer.assembly.build import ModelBuilder, load_model
    from infer.assembly.options import LoadOptions
    from infer.loader.config import load_config
    from infer.loader.weights import SafetensorsSource

    def build(path: Path, dtype: torch.dtype) -> Any:
        return load_model(ModelBuilder(SafetensorsSource(path), load_config(path), LoadOptions(dtype=dtype)))

    return _cached_per_checkpoint(build)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infer.testing import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


def processes_mentioning(text: str) -> list[int]:
    """Live processes (zombies aside) other than this one whose command line contains ``text``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture
def reap_processes(tmp_path: Path) -> Iterator[Callable[[], list[int]]]:
    """Yields a function listing the processes whose command line names a path under
    ``tmp_path``; at teardown each left is killed (its process group too, when it leads one:
    a builder's worker and compiler)."""
    marker = f"{tmp_path}{os.sep}"

    def ours() -> list[int]:
        return processes_mentioning(marker) if os.path.isdir("/proc") else []

    yield ours
    for pid in ours():
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker computes on one thread: two workers of two threads on two
    cores would spin against each other in OpenMP. (Tests that need more set it themselves.)"""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
