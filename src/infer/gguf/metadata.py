"""`GGUFMetadata`: typed access to one GGUF file's ``{arch}.*`` metadata keys and tensor table.

The architecture records' GGUF readers (`infer.models.arch.GGUFRules.metadata`) take one;
it implements `infer.models.arch.GGUFKeys`, the Protocol they name it by (the models sit below GGUF).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.gguf.reader import GGUFFile


class GGUFMetadata:
    """Typed access to a file's ``{arch}.*`` metadata and tensor table, with errors that name the key."""

    def __init__(self, gguf: GGUFFile, arch: str) -> None:
        self.gguf = gguf
        self.arch = arch
        self.path = gguf.path

    def full_key(self, key: str) -> str:
        return f"{self.arch}.{key}"

    def get(self, key: str) -> Any:
        return self.gguf.metadata.get(self.full_key(key))

    def _fail(self, key: str, value: Any, expected: str) -> ValueError:
        return ValueError(f"{self.path}: metadata '{self.full_key(key)}' = {value!r}, expected {expected}")

    def opt_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, value, "an integer")
        if value <= 0:
            raise self._fail(key, value, "an integer > 0")
        return value

    def int(self, key: str) -> int:
        value = self.opt_int(key)
        if value is None:
            raise ValueError(f"{self.path}: missing metadata key '{self.full_key(key)}'")
        return value

    def opt_float(self, key: str, default: float | None = None) -> float | None:
        """A positive, finite number (epsilons, RoPE bases and factors are all positive)."""
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._fail(key, value, "a number")
        if not math.isfinite(value) or value <= 0:
            raise self._fail(key, value, "a finite number > 0")
        return float(value)

    def opt_str(self, key: str) -> str | None:
        value = self.get(key)
        return value if isinstance(value, str) else None

    def has_tensor(self, name: str) -> bool:
        return name in self.gguf.tensors

    def float_vector(self, name: str) -> list[float]:
        """The values of a 1-D F32 tensor (a few hundred at most: RoPE factors), each finite and > 0."""
        from gguf.constants import GGMLQuantizationType

        info = self.gguf.tensors[name]
        if info.ggml_type != GGMLQuantizationType.F32 or len(info.shape) != 1:
            raise ValueError(
                f"{self.path}: tensor {name!r} is {info.type_name} {list(info.shape)}, "
                "expected a 1-D F32 vector"
            )
        values = [float(v) for v in self.gguf.read(name).view("<f4")]
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"{self.path}: tensor {name!r} holds values that are not finite and > 0")
        return values


__all__ = ["GGUFMetadata"]
