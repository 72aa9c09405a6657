"""Chat prompts: the chat template a checkpoint declares, and messages through it (``dllm generate --chat``, eval,
``dllm serve``'s /v1/chat/completions).

A folder declares its template as Hugging Face folders do: ``chat_template.jinja`` beside the tokenizer, or the
``chat_template`` key of ``tokenizer_config.json``; transformers reads either into ``tokenizer.chat_template``, and
``dllm.load`` of one of the project's own folders does the same (``folder_chat_template``). The shipped models'
folders declare their training format, ``Question: ...\\nAnswer:`` (``dllm.data.synthetic.format_example``).
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"  # the file name transformers reads and writes


def folder_chat_template(folder: str | Path) -> str | None:
    """The chat template ``folder`` declares (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``: a string, or a list of named templates whose ``default`` is taken), or None."""
    folder = Path(folder)
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text()
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` (or None) carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def missing_chat_template(tokenizer, fix: str) -> str:
    """The one message for a tokenizer without a chat template, every route's, ending in ``fix``."""
    name = type(tokenizer).__name__ if tokenizer is not None else "None"
    return (f"tokenizer {name} has no chat template (a model folder declares one in {TEMPLATE_FILE} or in "
            f"tokenizer_config.json's chat_template): {fix}")


def apply_chat_template(tokenizer, prompt: str) -> str:
    """One user turn plus the assistant header, as text.

    The text already holds the template's special tokens (e.g. LLaDA's BOS), so encode it with
    ``add_special_tokens=False``.
    """
    if not has_chat_template(tokenizer):
        raise ValueError(missing_chat_template(tokenizer, "pass the prompt as plain text instead"))
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
