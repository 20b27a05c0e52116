"""The KV operations: every change the scheduler makes to the KV slots, typed.

`infer.kv.slots.KVSlots.apply` makes one; the engine's slots record each with how it went
(`Done`), and under torchrun the other ranks make the same ones (`infer.engine.plan.Plan.ops`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reserve:
    """At least ``rows`` rows of ``capacity`` slots (`KVSlots.reserve`)."""

    rows: int
    capacity: int


@dataclass(frozen=True)
class Rollback:
    """Row ``row`` cut to the first ``length`` tokens of its sequence (`KVSlots.rollback`)."""

    row: int
    length: int


@dataclass(frozen=True)
class SharePrefix:
    """Row ``dst`` continues the first ``count`` tokens of row ``src`` (`KVSlots.share_prefix`)."""

    src: int
    count: int
    dst: int


@dataclass(frozen=True)
class Shrink:
    """Slots no row needs given back (`KVSlots.shrink`)."""


@dataclass(frozen=True)
class SetBound:
    """The most tokens row ``row`` may hold while its request runs, 0: none (`KVSlots.set_bound`)."""

    row: int
    bound: int


KVOp = Reserve | Rollback | SharePrefix | Shrink | SetBound


@dataclass(frozen=True)
class Done:
    """A KV operation as rank 0 made it: ``error`` is what it raised there (None: it went through).
    Another rank making it must get the same outcome, else the ranks' KV slots diverged."""

    op: KVOp
    error: str | None = None


__all__ = ["Done", "KVOp", "Reserve", "Rollback", "SetBound", "SharePrefix", "Shrink"]
