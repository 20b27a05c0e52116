"""A streamed model that is dropped frees everything: its reader thread and its converted-layer files.

A packed GGUF model streams from a local stream file that the `StreamStore` writes at
load into a temporary directory (about the size of the packed file). Found by
benchmarks/fuzz.py, which once left a directory per input whose load failed after the
layers were written, and a model that ran was kept alive by its reader thread. The
store is closed by the executor's finalizer (which holds nothing that reaches the
model), and a failed load closes what it wrote.
"""

from __future__ import annotations

import gc
import struct
import threading
from pathlib import Path

import pytest
import torch

import infer
from infer.gguf.writer import write_gguf
from infer.streaming import StreamingConfig
from infer.testing import build_tokenizer, tiny_hf_model

STREAMING = StreamingConfig(memory_budget="1GB", layer_group_size=1, max_resident_layers=0)


def readers() -> int:
    return sum(t.name == "infer-streaming-reader" for t in threading.enumerate())


def layer_dirs(root: Path) -> set[Path]:
    return set(root.glob("infer-stream-*"))


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return write_gguf(tmp_path / "tiny.gguf", model, build_tokenizer(tmp_path / "tok"), qtype="Q8_0")


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import tempfile

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def test_failed_streamed_load_removes_converted_layers(gguf: Path, private_tmp: Path) -> None:
    """The layers are converted, then the tokenizer metadata is refused: nothing may stay behind."""
    data = bytearray(gguf.read_bytes())
    key = b"tokenizer.ggml.eos_token_id"
    pos = data.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, pos)[0] == 4  # uint32
    struct.pack_into("<I", data, pos + 4, 99999)
    bad = gguf.with_name("bad-eos.gguf")
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="eos_token_id"):
        infer.load(bad, dtype=torch.float32, streaming=STREAMING)
    gc.collect()
    assert not layer_dirs(private_tmp), "converted layers left behind"


def test_dropped_streamed_gguf_model_is_freed(gguf: Path, private_tmp: Path) -> None:
    before = readers()
    llm = infer.load(gguf, dtype=torch.float32, streaming=STREAMING)
    assert len(llm.generate("hello", max_new_tokens=3).token_ids) == 3
    assert len(layer_dirs(private_tmp)) == 1 and readers() == before + 1
    del llm
    gc.collect()
    assert not layer_dirs(private_tmp), "the converted layers were not removed"
    assert readers() == before, "the reader thread still runs"
