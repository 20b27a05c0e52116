"""A file that shrinks under a running process gives a clean ``OSError``, never ``SIGBUS``.

Each scenario runs in a child process (a memory-map fault would kill it with signal 7,
exit code -7 / 135): the child opens a file, truncates it, keeps using what it opened
and prints what happened; the parent asserts a normal exit and ``OSError`` messages
naming the file. Files are truncated to one page, so the data used afterwards lies in
pages wholly past the end of the file (where a mapping faults).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

PAGE = 4096


def run_child(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    print(proc.stdout + proc.stderr[-3000:])
    assert proc.returncode == 0, f"child exited with {proc.returncode} (negative: killed by that signal)"
    return proc.stdout


def test_gguf_file_truncated_after_open(tmp_path: Path) -> None:
    path = tmp_path / "big-header.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_string("t.padding", "x" * 3 * PAGE)  # pushes what follows past the first pages
    w.add_array("t.tokens", [f"token-{i}" for i in range(2000)])
    w.add_array("t.scores", [float(i) for i in range(2000)])
    w.add_tensor("a.weight", np.arange(4 * PAGE, dtype=np.float32).reshape(16, -1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = run_child(
        f"""
        import os
        from infer.gguf.reader import GGUFFile
        f = GGUFFile({str(path)!r})
        os.truncate({str(path)!r}, {PAGE})
        tokens = f.metadata["t.tokens"]
        print("tokens", tokens[0], tokens[1999], len(tokens.tolist()))
        print("scores", float(f.metadata["t.scores"][1999]))
        print("digest", len(f.header_digest()))
        try:
            f.read("a.weight")
        except OSError as e:
            print("OSError:", e)
        try:
            f.raw("a.weight")
        except OSError as e:
            print("OSError:", e)
        """
    )
    assert "tokens token-0 token-1999 2000" in out
    assert "scores 1999.0" in out
    errors = [line for line in out.splitlines() if line.startswith("OSError:")]
    assert len(errors) == 2
    assert all(str(path) in e and "'a.weight'" in e for e in errors)


@pytest.mark.slow
def test_streamed_embedding_rows_after_truncation(tmp_path: Path) -> None:
    from infer.testing import build_checkpoint

    path = build_checkpoint(tmp_path / "ckpt", "llama", vocab_size=4096)
    file = path / "model.safetensors"
    assert file.stat().st_size > 64 * PAGE
    out = run_child(
        f"""
        import os
        import torch
        import infer
        from infer.streaming import StreamingConfig
        streaming = StreamingConfig(
            memory_budget="1GB", layer_group_size=1, max_resident_layers=0, resident_embeddings=False,
            max_context=64,
        )
        llm = infer.load({str(path)!r}, dtype=torch.float32, streaming=streaming)
        ids = torch.tensor([[3, 4000, 17, 4000]])
        positions = torch.arange(4)[None]
        with torch.inference_mode():
            before = llm.model.embed(ids, positions)
        print("rows", tuple(before.shape))
        print("generated", len(llm.generate("hello", max_new_tokens=2).token_ids))
        os.truncate({str(file)!r}, {PAGE})
        for attempt in range(2):
            try:
                with torch.inference_mode():
                    llm.model.embed(ids, positions)
                print("embed: no error")
            except OSError as e:
                print("OSError:", e)
            try:
                llm.generate("hello", max_new_tokens=2)
                print("generate: no error")
            except OSError as e:
                print("OSError:", e)
        """
    )
    assert "rows (1, 4, 64)" in out
    assert "generated 2" in out
    errors = [line for line in out.splitlines() if line.startswith("OSError:")]
    assert len(errors) == 4, out
    assert all(str(file) in e for e in errors)
    assert "no error" not in out
