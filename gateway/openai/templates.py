"""Chat templates: a model's Jinja `chat_template`, rendered as Hugging Face transformers does.

Same environment as `transformers` (sandboxed, `trim_blocks`, `lstrip_blocks`, `loopcontrols`,
a non-ASCII-safe `tojson`, `raise_exception`, `strftime_now`, a no-op `{% generation %}` block)
and the same variables (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`), so a
template from a model's tokenizer_config.json renders here exactly as it does there.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import BadRequest, GenqError

_TEMPLATES_KEPT = 32
"""Compiled templates cached per process (one per distinct template text)."""


class TemplateRaised(Exception):
    """What the template's own `raise_exception(message)` raises: the caller's input is bad."""


class InvalidTemplate(GenqError):
    """The template itself does not compile: the model (or GENQ_*_CHAT_TEMPLATE) is at fault."""

    code = "invalid_chat_template"


class _GenerationBlock(Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training; here a no-op."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=_TEMPLATES_KEPT)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by its text); InvalidTemplate if it does not compile."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidTemplate(f"the model's chat template does not compile: {exc}") from None


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages`; BadRequest (param `messages`) when the template refuses."""
    template = compile_template(source)
    try:
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **extra,
        )
    except TemplateRaised as exc:
        raise BadRequest(str(exc), param="messages", code="chat_template_error") from None
    except jinja2.TemplateError as exc:
        raise BadRequest(
            f"the model's chat template failed on these messages: {exc}",
            param="messages",
            code="chat_template_error",
        ) from None
