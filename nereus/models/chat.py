"""Chat templates: a tokenizer folder's Jinja template, rendered the way transformers does.

An instruction model's folder says how a conversation becomes text: ``chat_template.jinja``
(transformers 5 writes it beside the tokenizer) or the ``chat_template`` entry of
``tokenizer_config.json`` (older folders). ``load_chat_template(folder)`` reads whichever
is there; ``render_chat(template, messages, special_tokens)`` renders ``messages`` (a list
of ``{"role", "content"}`` maps) with ``add_generation_prompt`` and the folder's special
tokens (``bos_token``, ``eos_token``, ...) in scope, so the text equals transformers'
``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``. The text is
then tokenized without adding special tokens (the template already placed them).

Templates are code from a model's folder: they run in Jinja's immutable sandbox, with
only the helpers transformers gives them (``raise_exception``, ``strftime_now``, a
``tojson`` that does not escape HTML) and with ``trim_blocks`` and ``lstrip_blocks``
set, as transformers sets them.

Refuses (``ConfigError``): a template that does not compile or raises while rendering
(the message names the folder and Jinja's error), messages that are not role/content
maps of strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError

__all__ = ["load_chat_template", "render_chat", "check_messages", "CHATML_TEMPLATE"]

TEMPLATE_FILE = "chat_template.jinja"

# ChatML, as Qwen and SmolLM2 write it (without a default system turn): the template the
# tiny test tokenizers carry.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_chat_template(folder: str | Path) -> str | None:
    """The chat template of the tokenizer in ``folder``, or None when it has none."""
    d = Path(folder)
    file = d / TEMPLATE_FILE
    if file.is_file():
        return file.read_text()
    config = d / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except json.JSONDecodeError as e:
        raise ConfigError(f"{str(config)!r} is not valid JSON: {e}") from None
    if isinstance(template, list):  # several named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role": str, "content": str}``; ``ConfigError`` naming
    ``where`` otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError(
            f"{where}: expected a non-empty list of chat messages, got {messages!r:.200}"
        )
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ConfigError(
                f"{where}: message {i} must be a map with string 'role' and 'content', got "
                f"{m!r:.200}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, str]],
    special_tokens: Mapping[str, str | None] | None = None,
    add_generation_prompt: bool = True,
    where: str = "chat template",
) -> str:
    """The text of ``messages`` under ``template`` (see the module docstring)."""
    import jinja2

    msgs = check_messages(messages, where)
    try:
        return _compile(template).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **dict(special_tokens or {})
        )
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError(f"{where}: rendering failed: {type(e).__name__}: {e}") from e
