"""Render a conversation into the prompt text a chat model was trained on, the way Hugging Face does.

Checkpoints ship a Jinja template (GGUF `tokenizer.chat_template`, tokenizer_config.json `chat_template`).
We render it in the same environment as transformers' `apply_chat_template` so prompts match byte for
byte: a sandbox (templates come from downloaded files), trim_blocks + lstrip_blocks, a `tojson` that
does not HTML-escape, and the `raise_exception` / `strftime_now` globals templates call.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta as jinja2meta
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "user", "assistant", "tool"})

# For checkpoints without a template: plain ChatML, the format SmolLM2 and Qwen use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render (the message says which and why)."""


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Prompt text for `messages`; `template=None` means the checkpoint has none (ChatML is used).

    `extra` reaches the template as variables too (e.g. `tools=[...]`, `documents=[...]`).
    """
    validate_messages(messages)
    if template is None:
        log.debug("no chat template in the checkpoint; using ChatML")
        template = CHATML_TEMPLATE
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a string, got {type(template).__name__}")
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except jinja2.TemplateError as exc:  # raise_exception() lands here too, with the template's own text
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:  # Python errors inside expressions
        raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Reject what a template would mangle silently: wrong shapes, unknown roles, non-text content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; expected one of {sorted(ROLES)}")
        content = message.get("content")
        # An assistant turn that only calls tools may carry no text.
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] ({role}) content must be a string, got {type(content).__name__}")


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for HF's training masks; render it as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; prompts need the characters as they are (as HF does).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def template_variables(template: str | None) -> frozenset[str]:
    """The variables a template reads (e.g. whether it takes `tools`)."""
    if template is None:
        template = CHATML_TEMPLATE
    try:
        return frozenset(jinja2meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)  # a server renders the same one or two templates for every request
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from exc
