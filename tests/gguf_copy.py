"""Rewriting GGUF test files: copy every tensor of an open file into a writer, then write it out."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from infer.gguf.reader import GGUFFile


def copy_tensors_and_close(f: GGUFFile, w: GGUFWriter) -> None:
    """Add `f`'s tensors as stored (F32 as floats, packed ones as bytes) to `w`; write the file."""
    for name, info in f.tensors.items():
        raw = f.read(name)
        if info.ggml_type == GGMLQuantizationType.F32:
            w.add_tensor(name, raw.view(np.float32).reshape(info.shape))
        else:
            w.add_tensor(name, raw.reshape(info.shape[0], -1), raw_dtype=info.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
