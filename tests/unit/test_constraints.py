"""`infer.text.structured`: constraints, and the per-row logits processing checked against the definitions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infer.text.structured import (
    Constraint,
    ConstraintError,
    Grammars,
    RowProcessor,
    check_logit_bias,
    constraint_of,
)


def test_penalties_and_bias_follow_their_definitions() -> None:
    """OpenAI: logit -= frequency * count + presence * (count > 0); vLLM / transformers' repetition
    penalty divides a positive logit and multiplies a negative one of every token seen (prompt too)."""
    V = 8
    p = RowProcessor(
        V, prompt=[5], logit_bias=((1, 3.0), (7, -100.0)),
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
    )  # fmt: skip
    for token in (2, 2, 4):
        assert p.accept(token) is False  # no constraint: never complete
    logits = torch.tensor([1.0, 2.0, 4.0, -1.0, -3.0, 6.0, 0.5, 0.0])
    assert p.apply(logits) is None  # no constraint: every token allowed
    expected = [
        1.0,
        2.0 + 3.0,
        4.0 / 2 - (0.25 * 2 + 0.5),
        -1.0,
        -3.0 * 2 - (0.25 + 0.5),
        6.0 / 2,
        0.5,
        -100.0,
    ]
    assert logits.tolist() == pytest.approx(expected)


def test_the_mask_admits_exactly_what_the_grammar_does(tiny_ckpt_factory: Callable[..., Path]) -> None:
    import infer

    llm = infer.load(tiny_ckpt_factory("llama"))
    V = llm.model.vocab_size
    grammars = Grammars(llm.tokenizer, V, llm.eos_ids)

    def tok(ch: str) -> int:  # the tiny tokenizer: one token per byte
        ids = llm.tokenizer.encode(ch, add_special_tokens=False)
        assert len(ids) == 1
        return ids[0]

    def allowed(p: RowProcessor) -> list[int]:
        ids = p.apply(torch.zeros(V))
        assert ids is not None
        return [int(i) for i in ids]

    p = RowProcessor(V, [], matcher=grammars.matcher(Constraint.regex("(ab|cd)[0-9]")))
    assert allowed(p) == sorted([tok("a"), tok("c")])
    assert p.accept(tok("c")) is False
    assert allowed(p) == [tok("d")]
    p.accept(tok("d"))
    assert allowed(p) == sorted(tok(str(d)) for d in range(10))
    assert p.accept(tok("7")) is True  # complete: only EOS may follow
    assert allowed(p) == sorted(llm.eos_ids)
    # A token the grammar refuses puts the processor in error (the engine ends the request with it).
    q = RowProcessor(V, [], matcher=grammars.matcher(Constraint.regex("a")))
    q.accept(tok("z"))
    assert q.error is not None and "refused" in q.error
    # One that matches no text is refused when it is compiled, naming it, not at the first token.
    with pytest.raises(ConstraintError, match=r"regex: matches no text"):
        grammars.matcher(Constraint.regex(r"[^\s\S]"))
    with pytest.raises(ConstraintError, match=r"regex: matches no text"):
        grammars.matcher(Constraint.regex(r"a[^\s\S]b"))


def test_constraints_are_made_and_refused_with_the_argument_named() -> None:
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: int

    c = Constraint.json_schema(Point)
    assert c.kind == "json_schema" and c.model is Point and '"x"' in c.source
    assert Constraint.json_schema('{"type": "integer"}') == Constraint.json_schema({"type": "integer"})
    assert constraint_of(regex="a+") == Constraint.regex("a+") and constraint_of() is None
    with pytest.raises(ValueError, match="at most one of json_schema, regex and grammar"):
        constraint_of(json_schema={}, regex="a")
    with pytest.raises(ConstraintError, match="json_schema: not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(TypeError, match="json_schema must be"):
        Constraint.json_schema(3)
    with pytest.raises(ConstraintError, match="regex is empty"):
        Constraint.regex("")
    with pytest.raises(ConstraintError, match=r"grammar: .*Rule 'nothing' not found"):
        Constraint.grammar("root ::= nothing").llguidance_grammar()  # GBNF that does not convert


def test_logit_bias_is_checked() -> None:
    assert check_logit_bias({"5": 1, 3: -2.5}) == ((3, -2.5), (5, 1.0))  # OpenAI sends the ids as strings
    assert check_logit_bias(None) == ()
    for bad, match in [
        ({"x": 1}, "keys must be token ids"),
        ({5: 101}, r"logit_bias\[5\]: must be in \[-100, 100\]"),
        ({5: float("nan")}, "finite"),
        ({-1: 1}, "out of range"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_logit_bias(bad)
    with pytest.raises(ValueError, match=r"token id 300 is out of range \[0, 272\)"):
        check_logit_bias({300: 1}, vocab_size=272)
