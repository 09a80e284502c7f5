"""Chat templates rendered under bounds.

A chat template is code from the model directory (Jinja). transformers renders it in
jinja2's sandbox, which stops attribute tricks but not a template that loops for ever
or builds gigabytes; calibration renders it here instead: the same settings and
globals as transformers (so the text is the same), plus bounds on time, loop
iterations, ``range()`` sizes and the size of everything the template builds, enforced
on every loop iteration, call, attribute access, operator, filter and output chunk.
"""

from __future__ import annotations

import functools
import json
import re
import time
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from .data import CalibrationDataError, one_line

#: what rendering one row's chat template may take: wall-clock seconds, loop iterations
#: (every loop of the render together), numbers in one ``range()``, and characters of
#: the output or of any value it builds (plus twice the row's own characters). A real
#: template stays far below each: it loops over the messages once or twice.
TEMPLATE_SECONDS = 10.0
TEMPLATE_ITERATIONS = 1_000_000
TEMPLATE_RANGE = 10_000
TEMPLATE_CHARS = 16 << 20
#: the largest integer (in bits) a template may compute
_TEMPLATE_INT_BITS = 1 << 16
#: the filters whose numbers are widths or counts (at most the character cap)
_WIDTH_FILTERS = frozenset(("center", "indent", "wordwrap", "truncate", "batch", "slice"))
#: the filters that build a string as long as their input (checked before they run)
_STRING_FILTERS = frozenset(
    ("tojson", "pprint", "string", "join", "replace", "center", "indent", "wordwrap", "urlize",
     "xmlattr", "list", "trim", "upper", "lower")
)  # fmt: skip


class _TemplateLimit(Exception):
    """A chat template past one of the bounds (``str``: which, in words)."""


class _Budget:
    def __init__(self, chars: int):
        self.deadline = time.monotonic() + TEMPLATE_SECONDS
        self.chars = chars
        self.steps = 0
        self.iterations = 0

    def tick(self) -> None:
        self.steps += 1
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise _TemplateLimit(f"runs for more than {TEMPLATE_SECONDS:g} s")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > TEMPLATE_ITERATIONS:
            raise _TemplateLimit(f"runs more than {TEMPLATE_ITERATIONS:,} loop iterations")
        self.tick()


def _size(v: Any, limit: int) -> int:
    """About how many characters ``v`` renders to: its strings' lengths and one per other
    item, walked until past ``limit`` (so a list of a million references to one string
    counts what it would print, at bounded cost)."""
    if isinstance(v, (str, bytes)):
        return len(v)
    if not isinstance(v, (list, tuple, dict, set, frozenset)):
        return 1
    total, stack = 0, [v]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, (str, bytes)):
            total += len(x)
        elif isinstance(x, dict):
            total += 1 + len(x)
            if total <= limit:
                stack.extend(x.keys())
                stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            total += 1 + len(x)
            if total <= limit:
                stack.extend(x)
        else:
            total += 1
    return total


_DIGITS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\d*)(?:\.(\d*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")


def _big_number_in(fmt: str, limit: int) -> bool:
    """A width or precision above ``limit`` in a ``%`` or ``str.format`` format string."""
    nums = [n for m in _PERCENT_SPEC.finditer(fmt) for n in m.groups() if n]
    nums += [n for m in _BRACE_SPEC.finditer(fmt) for n in _DIGITS.findall(m.group(1))]
    return any(len(n) > 9 or int(n) > limit for n in nums)


class _Generator(CodeGenerator):
    """Python code in which what a ``{% for %}`` iterates is counted item by item
    (``environment.k3_iter``) and every ``a ~ b`` is checked once built."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.k3_iters: set[int] = set()

    def visit_For(self, node, frame):
        self.k3_iters.add(id(node.iter))
        super().visit_For(node, frame)

    def visit(self, node, *args, **kwargs):
        if id(node) not in self.k3_iters:
            return super().visit(node, *args, **kwargs)
        self.write("environment.k3_iter(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    def visit_Concat(self, node, frame):  # a ~ b: checked once built
        self.write("environment.k3_sized(")
        super().visit_Concat(node, frame)
        self.write(")")


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant masks): the body as is."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _TemplateNamespace(Namespace):
    def __init__(*args, **kwargs):  # Namespace's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _bounded_range(*args):
    r = range(*args)
    if len(r) > TEMPLATE_RANGE:
        raise _TemplateLimit(f"asks for range() of {len(r):,} numbers (at most {TEMPLATE_RANGE:,})")
    return r


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The jinja2 sandbox a chat template renders in: transformers' settings (trim_blocks,
    lstrip_blocks, loop controls, ``{% generation %}``, tojson, raise_exception,
    strftime_now, namespace) plus the bounds above, enforced on every loop iteration,
    call, attribute access, operator, filter and output."""

    code_generator_class = _Generator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self.k3_sized,
                         extensions=[_Generation, "jinja2.ext.loopcontrols"])  # fmt: skip
        self.budget = _Budget(TEMPLATE_CHARS)
        self.globals.pop("lipsum", None)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace,
                            range=_bounded_range)  # fmt: skip
        self.filters["tojson"] = _tojson
        for name, f in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(name, f)

    # -- bounds --------------------------------------------------------------
    def k3_iter(self, iterable):
        b = self.budget
        for x in iterable:
            b.iterate()
            yield x

    def k3_sized(self, value, what="a value"):
        if _size(value, self.budget.chars) > self.budget.chars:
            raise _TemplateLimit(f"builds {what} of more than {self.budget.chars:,} characters")
        if isinstance(value, int) and value.bit_length() > _TEMPLATE_INT_BITS:
            raise _TemplateLimit(f"computes a number of more than {_TEMPLATE_INT_BITS:,} bits")
        return value

    def _numbers(self, args, kwargs, what):
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and abs(a) > self.budget.chars:
                raise _TemplateLimit(f"passes {what} a number too large ({str(a)[:20]})")

    def _pre_check(self, obj, args, kwargs, what):
        """The size of what ``obj(*args)`` would build, for the str methods that build
        large strings from small inputs (widths, replace, join, format)."""
        cap = self.budget.chars
        too_big = _TemplateLimit(f"builds a string of more than {cap:,} characters")
        owner = getattr(obj, "__self__", None)
        name = getattr(obj, "__name__", "")
        if isinstance(owner, str):
            if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
                self._numbers(args, kwargs, what)
            if name == "replace" and len(args) >= 2:
                old, new = args[:2]
                if isinstance(old, str) and isinstance(new, str):
                    grow = max(len(new) - len(old), 0)
                    if grow and len(owner) + owner.count(old) * grow > cap:
                        raise too_big
            items = args[0] if name == "join" and args else ()
            n = len(items) if isinstance(items, (list, tuple, str)) else 0
            if n and _size(items, cap) + n * len(owner) > cap:
                raise too_big

    def wrap_str_format(self, value):
        """``str.format`` / ``format_map`` as the sandbox wraps them, with the widths
        checked (in the string, or given as arguments: ``{:{}}``)."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        env, fmt = self, value.__self__

        def checked(*args, **kwargs):
            if _NESTED_SPEC.search(fmt):
                env._numbers(args, kwargs, "format()")
            if _big_number_in(fmt, env.budget.chars):
                raise _TemplateLimit("formats with a width or precision that is too large")
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(checked, wrapped)

    def _bounded_filter(self, name, f):
        env = self
        lead = 0 if getattr(f, "jinja_pass_arg", None) is None else 1  # context first

        @functools.wraps(f)
        def bounded(*args, **kwargs):
            env.budget.tick()
            if len(args) > lead:
                env._filter_check(name, args[lead], args[lead + 1 :], kwargs)
            return env.k3_sized(f(*args, **kwargs))

        return bounded

    def _filter_check(self, name, value, params, kwargs):
        """What filter ``name`` would build from ``value``: a width, count or format
        too large, or a string past the cap (join, replace, tojson, ...)."""
        cap = self.budget.chars
        too_big = _TemplateLimit(f"builds a string of more than {cap:,} characters")
        if name in _WIDTH_FILTERS:
            self._numbers(params, kwargs, f"filter '{name}'")
        if name == "indent" and isinstance(value, str):
            width = params[0] if params else kwargs.get("width", "")
            lines = value.count("\n") + 1
            if isinstance(width, str) and len(value) + lines * len(width) > cap:
                raise too_big
        if name == "format":
            if isinstance(value, str) and _big_number_in(value, cap):
                raise _TemplateLimit("formats with a width or precision that is too large")
            return
        if name in _STRING_FILTERS and _size(value, cap) > cap:
            raise too_big
        if name == "replace" and isinstance(value, str) and len(params) >= 2:
            old, new = params[:2]
            if isinstance(old, str) and isinstance(new, str):
                grow = max(len(new) - len(old), 0)
                if grow and len(value) + value.count(old) * grow > cap:
                    raise too_big
        if name == "join" and isinstance(value, (list, tuple, str)):
            sep = params[0] if params else kwargs.get("d", "")
            if isinstance(sep, str) and _size(value, cap) + len(value) * len(sep) > cap:
                raise too_big

    # -- the sandbox's hooks -------------------------------------------------
    def call(self, context, obj, /, *args, **kwargs):
        self.budget.tick()
        self._pre_check(obj, args, kwargs, "a call")
        return self.k3_sized(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        self.budget.tick()
        cap = self.budget.chars
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                many = isinstance(n, int) and n > 1
                if many and isinstance(seq, (str, list, tuple)) and _size(seq, cap) * n > cap:
                    raise _TemplateLimit(f"builds a value of more than {cap:,} characters")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right * left.bit_length() > _TEMPLATE_INT_BITS:
                raise _TemplateLimit(
                    f"computes a number of more than {_TEMPLATE_INT_BITS:,} bits")  # fmt: skip
        elif operator == "%" and isinstance(left, str):
            if "*" in left:  # widths given as arguments: %*d
                self._numbers(right if isinstance(right, tuple) else (right,), {}, "'%'")
            if _big_number_in(left, cap):
                raise _TemplateLimit("formats with a width or precision that is too large")
        return self.k3_sized(super().call_binop(context, operator, left, right))

    def getattr(self, obj, attribute):
        self.budget.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.budget.tick()
        return super().getitem(obj, argument)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    env = BoundedEnvironment()
    return env, env.from_string(template)


def chat_messages(messages) -> list[dict]:
    """A row's messages as transformers hands them to a template: keys whose value is
    None dropped, reasoning under each of the names templates read."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if r is not None:
            m = {"thinking": r, **m, "reasoning_content": r}
        out.append(m)
    return out


def render_chat_template(template: str, variables: dict, *, where: str, source: str) -> str:
    """``template`` rendered with ``variables`` in a bounded sandbox: a template that
    loops, grows or runs past the bounds (:data:`TEMPLATE_SECONDS`, ...) is a one-line
    CalibrationDataError naming ``source`` (the file it comes from), not a hang. ``where``:
    the row, for messages."""
    fix = (
        "a real template renders a chat in milliseconds, so this one is damaged or hostile - "
        "fix or remove it, or give the data as a 'text' column"
    )
    try:
        env, compiled = _compiled(template)
    except Exception as e:  # a syntax error
        raise CalibrationDataError(
            f"{source}: the chat template does not compile ({type(e).__name__}: "
            f"{one_line(e, 200)}); {fix}."
        ) from None
    extra = sum(_size(v, 1 << 62) for v in variables.values())
    env.budget = budget = _Budget(TEMPLATE_CHARS + 2 * extra)
    out: list[str] = []
    n = 0
    try:
        for chunk in compiled.generate(**variables):
            n += len(chunk)
            if n > budget.chars:
                raise _TemplateLimit(f"renders more than {budget.chars:,} characters")
            budget.tick()
            out.append(chunk)
    except _TemplateLimit as e:
        raise CalibrationDataError(f"{where}: the chat template of {source} {e}; {fix}.") from None
    except Exception as e:  # raise_exception(), a bad row, a sandbox refusal, recursion
        raise CalibrationDataError(
            f"{where}: the chat template of {source} failed on this row ({type(e).__name__}: "
            f"{one_line(e, 200)}); fix the row or the template."
        ) from None
    return "".join(out)
