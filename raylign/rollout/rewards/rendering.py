"""How a reward model reads a sample: the token ids of (prompt, response), as ``raylign rm`` trained it.

Four cases, first match wins:

1. the sample's metadata holds the prompt conversation under ``prompt_messages`` (a list of
   ``{role, content}``): the chat template renders it with the response as the assistant turn;
2. the tokenizer has no chat template: prompt tokens (with the tokenizer's special tokens), then
   response tokens, then eos, like the plain format of the training data;
3. the prompt is already rendered with this chat template (it ends with the template's
   generation prompt, as the prompts of an RL run do): the response and the template's
   end-of-turn text are appended to it;
4. otherwise the prompt is the user message of a two-turn conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROMPT_MESSAGES_KEY = "prompt_messages"

_PROBE_PROMPT = "raylign-probe-prompt"
_PROBE_REPLY = "raylign-probe-reply"


@dataclass(frozen=True)
class AssistantTurn:
    """The text a chat template puts around an assistant reply."""

    generation_prompt: str  # appended by add_generation_prompt, e.g. "<|im_start|>assistant\n"
    before_reply: str  # between that and the reply (some templates insert an empty think block)
    after_reply: str  # closes the turn, e.g. "<|im_end|>\n"


def _render(tokenizer: Any, messages: list[dict], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def assistant_turn(tokenizer: Any) -> AssistantTurn | None:
    """How the tokenizer's template wraps a reply, found by rendering a probe conversation; None if unclear."""
    if not tokenizer.chat_template:
        return None
    user = [{"role": "user", "content": _PROBE_PROMPT}]
    without_prompt = _render(tokenizer, user)
    with_prompt = _render(tokenizer, user, add_generation_prompt=True)
    full = _render(tokenizer, user + [{"role": "assistant", "content": _PROBE_REPLY}])
    if not with_prompt.startswith(without_prompt) or not full.startswith(with_prompt):
        return None
    generation_prompt = with_prompt[len(without_prompt) :]
    before, found, after = full[len(with_prompt) :].partition(_PROBE_REPLY)
    if not generation_prompt or not found:
        return None
    return AssistantTurn(generation_prompt, before, after)


def _checked_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"metadata '{PROMPT_MESSAGES_KEY}' must be a non-empty list of {{role, content}} messages")
    for message in value:
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise ValueError(f"metadata '{PROMPT_MESSAGES_KEY}' holds {message!r:.80}, not a {{role, content}} message")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def encode_sample(
    tokenizer: Any, turn: AssistantTurn | None, prompt: str, response: str, prompt_messages: Any = None
) -> list[int]:
    """Token ids of one sample by the rules in the module docstring (``turn`` from :func:`assistant_turn`)."""
    if prompt_messages is not None:
        if not tokenizer.chat_template:
            raise ValueError(f"metadata '{PROMPT_MESSAGES_KEY}' needs a tokenizer with a chat template")
        messages = _checked_messages(prompt_messages) + [{"role": "assistant", "content": response}]
        text = _render(tokenizer, messages)
    elif not tokenizer.chat_template:
        prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return prompt_ids + response_ids + eos
    elif turn is not None and prompt.endswith(turn.generation_prompt):
        text = prompt + turn.before_reply + response + turn.after_reply
    else:
        text = _render(tokenizer, [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}])
    # Rendered text already holds the template's special tokens (apply_chat_template does the same).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
