"""`StreamingConfig` validation (T-006) and size parsing."""

from __future__ import annotations

from typing import Any

import pytest

from infer.streaming import StreamingConfig, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GB", 6 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5G", int(1.5 * 2**30)),
        ("100 mb", 100 * 10**6),
        ("4096", 4096),
        (".5KiB", 512),
        (123, 123),
    ],
)
def test_parse_bytes(text: int | str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "six GB", "6XB", "", "GB", "-1GB", "1e9", 1.5, True, None,
        "9" * 400, "9" * 400 + "GB", "1" + "0" * 19, "8EB", "9300000TB", 2**63, 2**70, -1,
        "inf", "nan", "1e400", float("inf"), float("nan"), 1e400, -0.5, [1],
    ],
)  # fmt: skip
def test_parse_bytes_rejects(bad: Any) -> None:
    with pytest.raises(ValueError, match="memory_budget") as info:
        parse_bytes(bad, "memory_budget")
    print(str(info.value)[:160])


def test_parse_bytes_limits() -> None:
    assert parse_bytes(2**63 - 1) == 2**63 - 1
    assert parse_bytes("8388607TiB") == 8388607 * 2**40
    assert parse_bytes(0) == 0
    assert parse_bytes("0.1GB") == 10**8  # exact decimal arithmetic, no float rounding


@pytest.mark.parametrize("bad", ["9" * 400, float("inf"), float("nan"), -5, 2**64])
def test_streaming_config_bad_budgets(bad: Any) -> None:
    for field in ("memory_budget", "host_memory_budget"):
        with pytest.raises(ValueError, match=f"StreamingConfig.{field}"):
            StreamingConfig(**{field: bad})


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "60", [1]])
def test_read_timeout_rejects(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"StreamingConfig\.read_timeout") as info:
        StreamingConfig(read_timeout=bad)
    assert repr(bad) in str(info.value)


def test_read_timeout_accepts() -> None:
    assert StreamingConfig().read_timeout == 60.0
    assert StreamingConfig(read_timeout=None).read_timeout is None
    assert StreamingConfig(read_timeout=0.25).read_timeout == 0.25
    assert StreamingConfig(read_timeout=3).read_timeout == 3


def test_defaults_are_valid() -> None:
    config = StreamingConfig()
    assert config.layer_group_size is None and config.prefetch is None and config.pin_memory  # chosen to fit
    assert config.budget_bytes == 6 * 10**9 and config.host_budget_bytes == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layer_group_size": 0}, "layer_group_size"),
        ({"layer_group_size": -2}, "layer_group_size"),
        ({"layer_group_size": 2.0}, "layer_group_size"),
        ({"layer_group_size": True}, "layer_group_size"),
        ({"memory_budget": 0}, "memory_budget"),
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"host_memory_budget": -1}, "host_memory_budget"),
        ({"prefetch": "yes"}, "prefetch"),
        ({"pin_memory": 1}, "pin_memory"),
        ({"on_progress": 3}, "on_progress"),
        ({"max_context": 0}, "max_context"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_prefill_tokens": 0}, "max_prefill_tokens"),
        ({"max_resident_layers": -1}, "max_resident_layers"),
        ({"resident_embeddings": "no"}, "resident_embeddings"),
        ({"head": "no"}, "head"),
        ({"max_context": 64, "max_prefill_tokens": 128}, "max_prefill_tokens"),
    ],
)
def test_invalid_settings_rejected(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"StreamingConfig.{field}") as info:
        StreamingConfig(**kwargs)
    print(info.value)
    value = next(iter(kwargs.values())) if len(kwargs) == 1 else None
    if value is not None:
        assert repr(value) in str(info.value)  # the message shows what was found


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
