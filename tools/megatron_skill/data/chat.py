"""Conversations -> text pieces, each to be learned or not, through the tokenizer's chat template.

A line of chat data holds "messages" (a list of {"role": system | user | assistant, "content"})
or "prompt" and "response" (with an optional "system"). The conversation is written out by the
tokenizer's own chat template (tokenizer_config.json's chat_template or chat_template.jinja,
rendered with jinja2 as transformers renders it), so training sees the markup the model will be
prompted with. Which text is the assistant's is found the way the template itself draws the line:
for each assistant turn, the conversation up to it rendered with the generation prompt is the
context, and what the turn adds after that is the reply (its end-of-turn marker included, so the
model learns to stop). Only replies are learned; a template whose renderings do not extend each
other cannot be split this way and is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

ROLES = ("system", "user", "assistant")
# For the byte tokenizer (no template of its own): plain role markers.
# (Newlines as expressions: trim_blocks, which chat templates are rendered with, eats a newline
# that follows a block tag.)
BYTE_TEMPLATE = ("{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}"
                 "{% if m.role == 'assistant' %}{{ '<|end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def messages_of(obj: dict) -> list[dict[str, str]] | str:
    """The conversation of one JSONL object, or why it is not one."""
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "field 'messages' is not a non-empty list"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                return f"messages[{i}] is not an object with role (system, user, assistant) and string content"
        if not any(m["role"] == "assistant" and m["content"] for m in msgs):
            return "no assistant message with content: nothing to learn"
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    prompt, response = obj.get("prompt"), obj.get("response")
    if not isinstance(prompt, str) or not isinstance(response, str) or not response:
        return "neither 'messages' nor string 'prompt' and non-empty 'response'"
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        return "field 'system' is not a string"
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def template_of(folder: Path) -> tuple[str, dict[str, str]]:
    """A Hugging Face tokenizer folder's chat template and its special tokens' text; ValueError
    when it has none."""
    from .. import files

    cfg_path = folder / "tokenizer_config.json"
    cfg = (files.read_json_object(cfg_path, "/tokenizer", "tokenizer_config.json")
           if files.kind_of(cfg_path) != "missing" else {})
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not template and files.kind_of(folder / "chat_template.jinja") != "missing":
        template = files.read_text(folder / "chat_template.jinja", "/tokenizer", "chat template")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{folder} has no chat template (tokenizer_config.json's chat_template or "
                         "chat_template.jinja)")

    def text(key: str) -> str:
        v = cfg.get(key)
        return (v.get("content") if isinstance(v, dict) else v) or ""

    return template, {k: text(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}


class ChatTemplate:
    def __init__(self, source: str, specials: dict[str, str] | None = None):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "")
        self.template = env.from_string(source)
        self.specials = specials or {}

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.specials)

    def pieces(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The conversation's text in order as (text, learn) pieces; ValueError when the template's
        renderings do not extend each other."""
        from jinja2.exceptions import TemplateError

        out: list[tuple[str, bool]] = []
        done = ""
        try:
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                context = self.render(messages[:i], add_generation_prompt=True)
                whole = self.render(messages[:i + 1], add_generation_prompt=False)
                if not context.startswith(done) or not whole.startswith(context):
                    raise ValueError("the chat template does not render a conversation as its context followed by "
                                     "the reply (it rewrites earlier turns)")
                out += [(context[len(done):], False), (whole[len(context):], True)]
                done = whole
            rest = self.render(messages, add_generation_prompt=False)
        except TemplateError as e:
            raise ValueError(f"the chat template refused the conversation: {e}") from None
        if not rest.startswith(done):
            raise ValueError("the chat template renders the whole conversation differently from its turns")
        out.append((rest[len(done):], False))
        return [(t, learn) for t, learn in out if t]
