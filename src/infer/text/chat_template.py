"""Chat templates: checked messages, bounded rendering, and content that stays text.

`render_chat_template` runs a model's Jinja template in jinja2's immutable sandbox with
transformers' variables and helpers, within `RenderLimits`; `mark_control_tokens` /
`split_marked` keep control-token spellings inside messages as text. How: docs/reliability.md,
"Chat templates".
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2.utils import Namespace as _Namespace

from infer.params import check_unicode

MARK_OPEN = "\ufdd0"  # noncharacters: never in real text; stripped from messages before marking
MARK_CLOSE = "\ufdd1"
MAX_INT_BITS = 1 << 16  # integer results of template arithmetic (about 20,000 digits)


class ChatTemplateError(ValueError):
    """A chat template could not render these messages (its own error, a syntax error, or a limit)."""


@dataclass(frozen=True)
class RenderLimits:
    """What one rendering may use. ``max_chars`` bounds the output and any string or list built."""

    max_chars: int = 1 << 23  # 8 Mi; a real chat renders a few KB
    max_iterations: int = 250_000  # loop iterations, calls and filters, in total
    max_seconds: float = 2.0


# ---- messages -------------------------------------------------------------------


def _plain(value: Any, where: str) -> Any:
    """A copy of ``value`` made of JSON types only (what a template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: keys must be strings, found {k!r}")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where}: expected JSON data (str, number, bool, list, dict), found {type(value).__name__}"
    )


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A fresh, plain copy of ``messages``: a non-empty list of dicts with string ``role`` and ``content``.

    Other keys (``name``, ``tool_calls``, ...) are kept when they hold JSON data; keys
    whose value is None are dropped (as transformers does).
    """
    if not isinstance(messages, list | tuple):
        raise TypeError(
            f"messages must be a list of dicts like {{'role': 'user', 'content': '...'}}, "
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(
                f"message {i} must be a dict with string 'role' and 'content', "
                f"got {type(m).__name__} {m!r:.60}"
            )
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"message {i} has no {key!r}")
            if not isinstance(m[key], str):
                raise TypeError(f"message {i}: {key!r} must be a string, got {type(m[key]).__name__}")
        if not m["role"]:
            raise ValueError(f"message {i}: 'role' is empty")
        check_unicode(f"message {i}: 'content'", m["content"])
        plain = _plain(m, f"message {i}")
        out.append({k: v for k, v in plain.items() if v is not None})
    return out


# ---- control tokens in content --------------------------------------------------


def control_token_pattern(tokens: Sequence[str]) -> re.Pattern[str]:
    """A regex matching any of ``tokens``, longest first (a token wins over the tokens inside it)."""
    alternatives = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True) if t)
    return re.compile(alternatives or "(?!)")  # (?!) never matches


def mark_control_tokens(value: Any, pattern: re.Pattern[str]) -> Any:
    """Every string in ``value`` (dict values, list items), its control-token spellings wrapped in markers."""
    if isinstance(value, str):
        value = value.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
        return pattern.sub(lambda m: MARK_OPEN + m.group(0) + MARK_CLOSE, value)
    if isinstance(value, dict):
        return {k: mark_control_tokens(v, pattern) for k, v in value.items()}
    if isinstance(value, list):
        return [mark_control_tokens(v, pattern) for v in value]
    return value


def split_marked(text: str, pattern: re.Pattern[str]) -> list[tuple[str, bool]]:
    """``text`` as ``(piece, is_marked_token)`` pairs, markers removed.

    A template can separate a marker from its token (``content.split(...)``): such a
    lone marker is dropped but still breaks the text, so the text on either side
    cannot join into a control token.
    """
    marked = re.compile(f"{MARK_OPEN}({pattern.pattern}){MARK_CLOSE}|[{MARK_OPEN}{MARK_CLOSE}]")
    pieces: list[tuple[str, bool]] = []
    start = 0
    for m in marked.finditer(text):
        if m.start() > start:
            pieces.append((text[start : m.start()], False))
        if m.group(1) is not None:
            pieces.append((m.group(1), True))
        start = m.end()
    if start < len(text):
        pieces.append((text[start:], False))
    return pieces


# ---- bounded rendering ----------------------------------------------------------


class _Budget:
    """The limits of one rendering, and what it has used so far."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds
        self.iterations = 0

    def tick(self) -> None:
        self.iterations += 1
        if self.iterations > self.limits.max_iterations:
            raise ChatTemplateError(
                f"chat template ran more than {self.limits.max_iterations:,} loop iterations "
                "and calls (limit)"
            )
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template ran longer than {self.limits.max_seconds} s (limit)")

    def check(self, what: str, size: int) -> None:
        if size > self.limits.max_chars:
            raise ChatTemplateError(
                f"chat template would build {what} of {size:,}+ characters or items "
                f"(limit {self.limits.max_chars:,})"
            )

    def check_ints(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.limits.max_chars:
                raise ChatTemplateError(
                    f"chat template passed {a} to a call "
                    f"(limit {self.limits.max_chars:,} for widths and counts)"
                )

    def check_format(self, fmt: str, args: Any) -> None:
        """``fmt % args`` / ``fmt.format(...)``: widths and field count times argument size, bounded."""
        runs = re.findall(r"\d+", fmt)
        if any(len(r) > 12 for r in runs):
            raise ChatTemplateError("chat template uses a format width beyond the limit")
        values = args.values() if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
        widest = max([int(r) for r in runs] + [abs(v) for v in values if type(v) is int], default=0)
        fields = fmt.count("%") + fmt.count("{")
        self.check("a formatted string", len(fmt) + fields * (widest + self.text_size(args)))

    def text_size(self, value: Any) -> int:
        """About ``len(str(value))`` (or its JSON), within a small factor, counted up to just past the limit.

        A string counts its length; a container 4 per item plus its items, walked
        without recursion, so a list that holds itself many times over (``[a, a]``
        nested forty deep) is refused, not printed.
        """
        if isinstance(value, str):
            return len(value)
        limit, total, steps, stack = self.limits.max_chars, 0, 0, [value]
        while stack and total <= limit:
            x = stack.pop()
            steps += 1
            if steps % 4096 == 0:
                self.tick()
            if isinstance(x, str):
                total += len(x) + 4
            elif isinstance(x, int) and not isinstance(x, bool):
                total += x.bit_length() // 3 + 4
            elif isinstance(x, Mapping | list | tuple | set | frozenset):
                items = [*x.keys(), *x.values()] if isinstance(x, Mapping) else x
                total += 4 + 4 * len(items)
                if total <= limit:
                    stack.extend(items)
            elif isinstance(x, _Namespace):  # its attributes live in a name-mangled dict
                stack.append(object.__getattribute__(x, "_Namespace__attrs"))
            else:
                total += 4
        return total

    def counted(self, items: Iterator[Any]) -> Iterator[Any]:
        """``items`` (a filter's generator), raising once the strings and lists made add up past the limit."""
        total = 0
        for item in items:
            self.tick()
            total += len(item) if isinstance(item, str | list | tuple | dict) else 1
            self.check("a sequence", total)
            yield item

    def result(self, value: Any) -> Any:
        """``value`` after checking its size; an iterator comes back counted."""
        if isinstance(value, str | list | tuple | dict):
            self.check("a value", len(value))
        elif isinstance(value, types.GeneratorType | Iterator):
            return self.counted(value)
        return value


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("infer_chat_template_budget")


def _budget() -> _Budget:
    return _BUDGET.get()


def _estimate_str_method(method: Any, args: Sequence[Any]) -> int | None:
    """The length of ``method(*args)`` for the str methods that can grow text far beyond their inputs."""
    s = getattr(method, "__self__", None)
    if not isinstance(method, types.BuiltinMethodType) or not isinstance(s, str):
        return None
    name = method.__name__
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        n = s.count(args[0]) if args[0] else len(s) + 1
        return len(s) + n * len(args[1])
    if name == "join" and args and isinstance(args[0], list | tuple | Mapping):
        return sum(_budget().text_size(x) for x in args[0]) + len(s) * len(args[0])
    if name == "expandtabs":
        return len(s) + s.count("\t") * (args[0] if args and isinstance(args[0], int) else 8)
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        return len(s) + args[0]
    return None


def _estimate_filter(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    """The output length of the built-in filters that can grow text far beyond their input."""
    if not args:
        return None
    value, rest = args[0], args[1:]
    b = _budget()

    def arg(i: int, key: str, default: Any) -> Any:
        return rest[i] if len(rest) > i else kwargs.get(key, default)

    if name == "join" and isinstance(value, list | tuple | Mapping):
        return sum(b.text_size(x) for x in value) + len(str(arg(0, "d", ""))) * len(value)
    if name == "replace" and isinstance(value, str):
        old, new = str(arg(0, "old", "")), str(arg(1, "new", ""))
        return len(value) + (value.count(old) if old else len(value) + 1) * len(new)
    if name == "center" and isinstance(value, str):
        return len(value) + int(arg(0, "width", 80))
    if name == "indent" and isinstance(value, str):
        width = arg(0, "width", 4)
        return len(value) + (value.count("\n") + 1) * (len(width) if isinstance(width, str) else int(width))
    if name == "wordwrap" and isinstance(value, str):
        return len(value) * (1 + len(str(arg(3, "wrapstring", "\n") or "\n")))
    if name == "format" and isinstance(value, str):
        b.check_format(value, tuple(rest) or dict(kwargs))
        return None
    if name == "tojson":
        indent = arg(0, "indent", None)
        return b.text_size(value) * (1 + (len(indent) if isinstance(indent, str) else int(indent or 0)))
    if name in ("string", "pprint", "list", "e", "escape", "forceescape", "urlize"):
        return 6 * b.text_size(value)
    return None


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # context / environment first

    @functools.wraps(f)  # keeps jinja_pass_arg
    def bounded(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        b.check_ints(args[skip:], kwargs)
        estimate = _estimate_filter(name, args[skip:], kwargs)
        if estimate is not None:
            b.check(f"the result of the {name!r} filter", estimate)
        return b.result(f(*args, **kwargs))

    return bounded


def _concat(*parts: Any) -> str:
    """``a ~ b``: checked before the strings are built."""
    b = _budget()
    b.check("a '~' concatenation", sum(b.text_size(p) for p in parts))
    return "".join(str(p) for p in parts)


def _loop(items: Any) -> Iterator[Any]:
    """What every ``for`` iterates: the loop body runs once per tick."""
    b = _budget()
    for item in items:
        b.tick()
        yield item


def _finalize(value: Any) -> Any:
    b = _budget()
    b.check("a printed value", b.text_size(value))
    return value


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping (Jinja's own escapes <, >, &, ').
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in templates, without the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


def _namespace_class() -> type:
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    class TemplateNamespace(Namespace):
        """``namespace(...)`` whose attributes cannot start with an underscore."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature: `self` may be a key
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot set {name!r} on a namespace")

    return TemplateNamespace


@functools.cache
def _environment() -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            b = _budget()
            b.tick()
            numbers = all(isinstance(x, int | float) for x in (left, right))
            if operator == "*" and not numbers:
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    b.check("a '*' repetition", len(seq) * max(n, 0))
            elif operator == "*" and isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise ChatTemplateError("chat template multiplies integers beyond the limit")
            elif (
                operator == "+"
                and isinstance(left, str | list | tuple)
                and isinstance(right, str | list | tuple)
            ):
                b.check("a '+' concatenation", len(left) + len(right))
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right > 0 and left.bit_length() * right > MAX_INT_BITS:
                    raise ChatTemplateError("chat template raises an integer to a power beyond the limit")
            elif operator == "%" and isinstance(left, str):
                b.check_format(left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            b = _budget()
            b.tick()
            if __obj is _loop:
                return super().call(__context, __obj, *args, **kwargs)
            b.check_ints(args, kwargs)
            estimate = _estimate_str_method(__obj, args)
            if estimate is not None:
                b.check(f"the result of str.{__obj.__name__}", estimate)
            return b.result(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            fmt = super().wrap_str_format(value)
            if fmt is None:
                return None
            text: str = value.__self__

            def bounded(*args: Any, **kwargs: Any) -> str:
                _budget().check_format(text, args + tuple(kwargs.values()))
                return fmt(*args, **kwargs)

            return bounded

    env = BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, loopcontrols],
        finalize=_finalize,
        optimized=False,  # no constant folding at compile time: every operation runs checked
    )
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _bounded_filter("tojson", _tojson)
    env.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_namespace_class(),
        __infer_loop__=_loop,
        __infer_concat__=_concat,
    )
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    """The template with every ``for`` iterating through `_loop` and every ``~`` a call to `_concat`."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def call(name: str, args: list[Any], lineno: int) -> Any:
        return nodes.Call(nodes.Name(name, "load", lineno=lineno), args, [], None, None, lineno=lineno)

    class Checked(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            self.generic_visit(node)
            node.iter = call("__infer_loop__", [node.iter], node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            self.generic_visit(node)
            return call("__infer_concat__", node.nodes, node.lineno)

    env = _environment()
    tree = Checked().visit(env.parse(source))
    tree.set_environment(env)
    return env.from_string(tree)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    variables: Mapping[str, Any] | None = None,
    limits: RenderLimits | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render ``template`` for checked ``messages`` (see `check_messages`) within ``limits``.

    ``variables`` are the extra template variables (the tokenizer's special tokens:
    ``bos_token``, ``eos_token``, ...). Raises `ChatTemplateError` for a syntax error,
    an error the template raises (``raise_exception``), or a limit reached.
    """
    import jinja2

    limits = limits or RenderLimits()
    token = _BUDGET.set(_Budget(limits))
    try:
        try:
            compiled = _compile(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from None
        context = {
            **(variables or {}),
            "messages": messages,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        b = _budget()
        parts: list[str] = []
        size = 0
        try:
            for piece in compiled.generate(**context):
                size += len(piece)
                b.check("an output", size)
                b.tick()
                parts.append(piece)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e.message or type(e).__name__}") from None
        except (RecursionError, MemoryError, OverflowError, ArithmeticError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        except (TypeError, ValueError, LookupError, AttributeError) as e:
            raise ChatTemplateError(
                f"chat template failed on these messages: {type(e).__name__}: {e}"
            ) from None
        return "".join(parts)
    finally:
        _BUDGET.reset(token)


__all__ = [
    "ChatTemplateError",
    "RenderLimits",
    "check_messages",
    "control_token_pattern",
    "mark_control_tokens",
    "render_chat_template",
    "split_marked",
]
