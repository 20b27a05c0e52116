"""Tests of `infer serve` (a package, so its conftest is `serve.conftest` beside tests/conftest.py)."""
