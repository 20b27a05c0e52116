"""`infer.combinations`: docs/architecture.md shows its tables, and each check names both options.

What `infer.load` refuses is tests/integration/test_api_arguments.py's; every option alone and in
pairs, through the public API, is tests/integration/test_route_matrix.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.combinations import GIVES_WAY, REFUSED, check_intervention, check_load, check_request, markdown
from infer.params import SamplingParams

DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_architecture_page_shows_the_tables() -> None:
    """The page's *What cannot combine* holds `markdown()` verbatim: a rule changed in code and not
    in the page (or the reverse) fails here; paste `python -c "from infer.combinations import
    markdown; print(markdown())"` over the tables."""
    text = DOCS.read_text(encoding="utf-8")
    assert markdown() in text
    assert len(REFUSED) >= 1 and len(GIVES_WAY) >= 1


def test_checks_name_both_options_as_given() -> None:
    with pytest.raises(ValueError, match=r"^compile=True cannot combine with pipeline_parallel=4: "):
        check_load(compile=True, pipeline_parallel=4)
    with pytest.raises(ValueError, match=r"^an intervention cannot combine with tensor_parallel=2: "):
        check_intervention(tensor_parallel=2)
    with pytest.raises(ValueError, match=r"^quantize='int8' cannot combine with a GGUF file \(m\.gguf\): "):
        check_load(quantize="int8", gguf="m.gguf")


def test_what_combines_passes() -> None:
    check_load(compile="auto", streaming=object(), quantize="q4_0")  # auto gives way to streaming
    check_load(compile=True, quantize="int8")
    check_intervention()
    constrained = SamplingParams(logit_bias=((3, 1.0),), repetition_penalty=1.2, logprobs=2)
    check_request(constrained, speculative=True)  # speculation gives way (`GIVES_WAY`)
