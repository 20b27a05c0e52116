"""Chat templates: checked messages, bounded rendering in the sandbox, identical output to transformers.

Hostile templates (nested ``range(100000)``, ``'x' * 4000000000``, doubling
strings, self-nesting lists, format widths, ...) must fail quickly with
`ChatTemplateError` instead of allocating unbounded memory or hanging; the time each
takes is printed. Ordinary templates using the features real templates use must
render exactly what transformers' ``apply_chat_template`` renders.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from infer.text.chat_template import (
    ChatTemplateError,
    RenderLimits,
    check_messages,
    control_token_pattern,
    mark_control_tokens,
    render_chat_template,
    split_marked,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi <there> & 'you'  "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Tell me\nmore."},
]


def render(template: str, messages: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    return render_chat_template(template, check_messages(messages or MESSAGES), **kwargs)


# ---- hostile templates -------------------------------------------------------------------

LOOP_64 = "{% set n = namespace(s='ab', a=['ab'], x=3) %}{% for i in range(64) %}"

HOSTILE = {
    "nested range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string repeat": "{{ 'x' * 4000000000 }}",
    "repeat, reversed": "{{ 4000000000 * 'x' }}",
    "list repeat": "{{ ([0] * 100000000)|length }}",
    "~ doubling": LOOP_64 + "{% set n.s = n.s ~ n.s %}{% endfor %}",
    "+ doubling": LOOP_64 + "{% set n.s = n.s + n.s %}{% endfor %}",
    "block-set doubling": LOOP_64 + "{% set t %}{{ n.s }}{{ n.s }}{% endset %}{% set n.s = t %}{% endfor %}",
    "self-nesting list printed": LOOP_64 + "{% set n.a = [n.a, n.a] %}{% endfor %}{{ n.a }}",
    "self-nesting list tojson": LOOP_64 + "{% set n.a = [n.a, n.a] %}{% endfor %}{{ n.a|tojson }}",
    "integer power": "{{ 7 ** 100000000 }}",
    "integer squaring": LOOP_64 + "{% set n.x = n.x * n.x %}{% endfor %}",
    "% width": "{{ '%999999999s' % 'x' }}",
    "format width": "{{ '{:>999999999}'.format('x') }}",
    "center filter": "{{ 'x'|center(1000000000) }}",
    "ljust method": "{{ 'x'.ljust(1000000000) }}",
    "replace": "{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}",
    "join": "{% set s = 'x' * 1000000 %}{{ ([s] * 100)|join }}",
    "map then join": "{{ (['a'] * 1000)|map('center', 1000000)|join }}",
    "expandtabs": "{% set s = '\t' * 1000000 %}{{ s.expandtabs(1000) }}",
    "indent": "{% set s = '\n' * 1000000 %}{{ s|indent(1000) }}",
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "exponential macro": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}"
    ),
    "lipsum": "{{ lipsum(100000, html=False) }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_fail_quickly(name: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError) as info:
        render(HOSTILE[name])
    print(f"\n{name}: {time.perf_counter() - t0:.3f} s -> {info.value}")


def test_time_limit() -> None:
    """The deadline stops work the counters allow (here: a million iterations of string work)."""
    template = (
        "{% for i in range(1000) %}{% for j in range(1000) %}{{ ('ab' * 500)|upper|length }}{% endfor %}"
        "{% endfor %}"
    )
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=r"longer than 0\.2 s"):
        render(template, limits=RenderLimits(max_seconds=0.2, max_iterations=10**9, max_chars=10**9))
    print(f"\ntime limit 0.2 s: stopped after {time.perf_counter() - t0:.3f} s")


def test_limits_are_settable() -> None:
    assert render("{{ 'x' * 100 }}", limits=RenderLimits(max_chars=100)) == "x" * 100
    with pytest.raises(ChatTemplateError, match="limit 99"):
        render("{{ 'x' * 100 }}", limits=RenderLimits(max_chars=99))
    with pytest.raises(ChatTemplateError, match="more than 10 loop iterations"):
        render("{% for i in range(11) %}{% endfor %}", limits=RenderLimits(max_iterations=10))


SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ messages.__class__.__base__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set n = namespace() %}{% set n._private = 1 %}",
    "{{ messages.append(1) }}",  # the sandbox is immutable
    "{{ cycler.__init__.__globals__ }}",
]


@pytest.mark.parametrize("template", SANDBOX_ESCAPES)
def test_sandbox_escapes_are_refused(template: str) -> None:
    """An unsafe attribute is an error when used, and prints as nothing when printed."""
    try:
        out = render(template)
    except ChatTemplateError as e:
        print(f"\n{template} -> {e}")
    else:
        assert out == ""


def test_template_errors_are_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="chat template error: roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match=r"syntax error \(line 1\)"):
        render("{% for %}")
    with pytest.raises(ChatTemplateError, match="chat template failed on these messages"):
        render("{{ messages[0]['content'] + 3 }}")
    assert issubclass(ChatTemplateError, ValueError)


# ---- identical to transformers ---------------------------------------------------------------

FEATURES_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(sys='', count=0) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}{%- set ns.sys = m['content'] | trim -%}{%- continue -%}{%- endif -%}
  {%- set ns.count = ns.count + 1 -%}
  {%- if ns.count > 5 -%}{%- break -%}{%- endif -%}
  {{ '<|' ~ m['role'] ~ '|>' }}{{ ns.sys + ': ' if loop.first and ns.sys else '' }}
  {%- generation -%}{{ m['content'].strip() | replace('\n', ' / ') }}{%- endgeneration -%}
  {{ ' [%d/%s]' % (loop.index, loop.length) }}{{ ' {}'.format(m['role'] | upper) }}
  {{- ' ' ~ (m | tojson) if m['role'] == 'assistant' else '' }}
  {%- if not loop.last %}{{ '\n' * 2 }}{% endif -%}
{%- endfor -%}
{{ ' ' + (dict(a=1, b=[1, 2]) | tojson) + ' ' + (range(3) | list | join(',')) }}
{{- ' ' + (tools is none) | string }}
{%- if add_generation_prompt %}{{ eos_token }}<|assistant|>{% endif %}"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_features_render_as_transformers_renders_them(
    tokenizer_dir: Any, add_generation_prompt: bool
) -> None:
    from infer.loader.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    tok.hf.chat_template = FEATURES_TEMPLATE
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    theirs = tok.hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    print(f"\n{ours!r}")
    assert ours == theirs
    assert "[3/4] ASSISTANT" in ours and '{"a": 1, "b": [1, 2]}' in ours  # the features ran


# ---- messages ----------------------------------------------------------------------------------

BAD_MESSAGES = [
    ("hello", TypeError, "messages must be a list of dicts"),
    ({"role": "user", "content": "hi"}, TypeError, "messages must be a list of dicts"),
    ([], ValueError, "messages is empty"),
    (["hello"], TypeError, "message 0 must be a dict with string 'role' and 'content', got str"),
    ([{"role": "user", "content": "hi"}, None], TypeError, "message 1 must be a dict"),
    ([{"content": "hi"}], ValueError, "message 0 has no 'role'"),
    ([{"role": "user"}], ValueError, "message 0 has no 'content'"),
    ([{"role": "user", "content": 3}], TypeError, "message 0: 'content' must be a string, got int"),
    ([{"role": "user", "content": None}], TypeError, "'content' must be a string, got NoneType"),
    ([{"role": ["user"], "content": "hi"}], TypeError, "'role' must be a string, got list"),
    ([{"role": "", "content": "hi"}], ValueError, "'role' is empty"),
    ([{"role": "user", "content": "hi", "x": object()}], TypeError, r"message 0\['x'\]: expected JSON data"),
    ([{"role": "user", "content": "hi", "x": {1: "a"}}], TypeError, "keys must be strings"),
]


@pytest.mark.parametrize(("messages", "error", "match"), BAD_MESSAGES)
def test_bad_messages_are_refused(messages: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_messages(messages)


def test_checked_messages_are_plain_copies() -> None:
    original = [{"role": "user", "content": "hi", "name": None, "meta": ({"k": (1, 2.5, True)},)}]
    checked = check_messages(original)
    assert checked == [{"role": "user", "content": "hi", "meta": [{"k": [1, 2.5, True]}]}]
    assert checked[0] is not original[0] and "name" in original[0]


# ---- marking control tokens ----------------------------------------------------------------------


def test_marking_and_splitting_round_trip() -> None:
    pattern = control_token_pattern(["<|im_end|>", "<|im_start|>", "<|im|>"])
    marked = mark_control_tokens(
        [{"content": "a<|im_end|>b<|im_start|>c\ufdd0<|im|>\ufdd1d", "n": [1, "<|im|>"]}], pattern
    )
    text = "<|im_start|>user\n" + marked[0]["content"] + "<|im_end|>" + marked[0]["n"][1]
    assert split_marked(text, pattern) == [
        ("<|im_start|>user\na", False),
        ("<|im_end|>", True),
        ("b", False),
        ("<|im_start|>", True),
        ("c", False),
        ("<|im|>", True),  # the forged markers were stripped; the real ones wrap the token
        ("d<|im_end|>", False),
        ("<|im|>", True),
    ]
    # a template that separates a marker from its token leaves a lone marker: it breaks the text
    assert split_marked("x\ufdd0y", pattern) == [("x", False), ("y", False)]
