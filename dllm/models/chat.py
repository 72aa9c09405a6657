"""Chat prompts: wrap a user message in the tokenizer's chat template (for ``dllm generate --chat`` and eval)."""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` (or None) carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer, prompt: str) -> str:
    """One user turn plus the assistant header, as text.

    The text already holds the template's special tokens (e.g. LLaDA's BOS), so encode it with
    ``add_special_tokens=False``.
    """
    if not has_chat_template(tokenizer):
        name = type(tokenizer).__name__ if tokenizer is not None else "None"
        raise ValueError(f"tokenizer {name} has no chat template; pass the prompt as plain text instead")
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# The shipped models' training format ("Question: ...\nAnswer: ...", dllm.data.synthetic.format_example) as a chat
# template, so that chat front ends (dllm serve's /v1/chat/completions) can reach them: each user turn is a
# question, each assistant turn its answer; a system message goes first as a line of its own.
TRAINING_FORMAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] in ('system', 'developer') -%}{{ message['content'] }}\n"
    "{%- elif message['role'] == 'user' -%}Question: {{ message['content'] }}\nAnswer:"
    "{%- else -%} {{ message['content'] }}\n"
    "{%- endif -%}"
    "{%- endfor -%}"
)
