r"""How a prompt becomes the target's input (data.template), for chat models and base models alike.

    data.template=chat                               # the tokenizer's chat template (the default)
    data.template='"Question: {prompt}\nAnswer:"'    # a base model: a plain format string
    generate.stop_strings='["\nQuestion:"]'          # ... whose answers end at a stop string

"chat" applies the tokenizer's chat template with the assistant header. A tokenizer without one gets
a plain "role: content" transcript ending in "assistant:" (FALLBACK_TEMPLATE for one user turn) and
one warning naming the option. A format string is filled with the user's text ({prompt}) and the
system prompt ({system}, optional) and tokenized as plain text. Generate (training prompts), evaluate
(every eval set, unless it sets its own template) and the model card's usage snippet all follow it.
A two-character \n or \t in data.template or generate.stop_strings (what a shell passes) means a newline
or a tab.
"""
from __future__ import annotations

import json
import logging
import string
from typing import Any, Optional

from distill.errors import ConfigError

log = logging.getLogger(__name__)

CHAT = "chat"
# What data.template=chat becomes for a tokenizer without a chat template: a "role: content" transcript,
# which for one user turn is this format.
FALLBACK_TEMPLATE = "user: {prompt}\nassistant:"
_warned: set[str] = set()  # tokenizers already warned about (one warning each per process)


def unescape(text: str) -> str:
    """\\n and \\t written as two characters (what a shell passes for "\\n" in a Hydra override) -> a
    newline and a tab, in data.template and generate.stop_strings; a YAML file's "\\n" is a newline already."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def stop_strings(values: Any) -> list[str]:
    """generate.stop_strings as the strings to look for (unescaped); [] for None."""
    return [unescape(str(v)) for v in (values or [])]


def template_problem(template: Optional[str]) -> Optional[str]:
    """Why `template` cannot be a data.template, or None when it can: "chat" (or null), or a Python format
    string with the field {prompt} and optionally {system}."""
    if template in (None, CHAT):
        return None
    template = unescape(template)
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        other = sorted(fields - {"prompt", "system"})
        if other:
            return f"{template!r} has the fields {other}; only {{prompt}} and {{system}} are filled in"
        template.format(prompt="", system="")
    except (ValueError, KeyError, IndexError, AttributeError) as e:
        return (f"{template!r} is not a format string ({type(e).__name__}: {e}); "
                "write a literal brace as {{ or }}")
    if "prompt" not in fields:
        return f"{template!r} has no {{prompt}} field, so the prompt would be dropped"
    return None


def uses_chat_template(tokenizer: Any, template: Optional[str] = CHAT) -> bool:
    """Whether prompts go through the tokenizer's chat template (data.template=chat and it has one)."""
    return template in (None, CHAT) and bool(getattr(tokenizer, "chat_template", None))


def effective_template(tokenizer: Any, template: Optional[str] = CHAT) -> str:
    """"chat", or the format string prompts are rendered with (FALLBACK_TEMPLATE when data.template=chat
    meets a tokenizer without a chat template)."""
    if uses_chat_template(tokenizer, template):
        return CHAT
    return FALLBACK_TEMPLATE if template in (None, CHAT) else unescape(template)


def warn_no_chat_template(tokenizer: Any) -> None:
    """Log, once per tokenizer, that data.template=chat falls back to a plain transcript."""
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    if name not in _warned:
        _warned.add(name)
        log.warning("the tokenizer of %s has no chat template: prompts become plain 'user: ...\\nassistant:' "
                    "transcripts (data.template=chat's fallback). For a base model set data.template to a format "
                    "string such as 'Question: {prompt}\\nAnswer:' (and generate.stop_strings to end its answers)",
                    name)


def format_prompt(template: str, messages: list[dict]) -> str:
    """A one-turn conversation (optionally after a system turn) through a data.template format string."""
    template = unescape(template)
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if len(rest) != 1 or rest[0]["role"] != "user":
        raise ConfigError(f"data.template={template!r} formats one user turn, but a prompt has the turns "
                          f"{[m['role'] for m in messages]}; use data.template=chat for conversations")
    if system and "{system}" not in template:
        raise ConfigError(f"a prompt has a system turn but data.template={template!r} has no {{system}} field; "
                          "add one, or drop data.system_prompt")
    return template.format(prompt=rest[0]["content"], system=system)


def prompt_code(tokenizer: Any, template: Optional[str] = CHAT, text: str = "Hello!") -> str:
    """Python lines (for a model card) that build `inputs` the way this project prompted the target."""
    quoted = json.dumps(text)
    if uses_chat_template(tokenizer, template):
        return (f'inputs = tok.apply_chat_template([{{"role": "user", "content": {quoted}}}], add_generation_prompt=True,\n'
                f'                                 return_tensors="pt", return_dict=True)')
    fmt = effective_template(tokenizer, template)
    system = ', system=""' if "{system}" in fmt else ""
    return f'inputs = tok({fmt!r}.format(prompt={quoted}{system}), return_tensors="pt")'
