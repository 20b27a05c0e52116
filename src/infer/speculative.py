"""The speculative-decoding names under their first module's name: they live in `infer.spec`."""

from infer.spec import *  # noqa: F403
from infer.spec import __all__ as __all__
