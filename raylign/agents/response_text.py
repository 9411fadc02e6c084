"""The text of a sampled response as an OpenAI client sees it, and which tokens it leaves out.

The returned text ends before the stop string or end-of-sequence token that ended it (as OpenAI's)
and keeps the special tokens the model sampled before (``<|pad|>``, a stray ``<|im_start|>``), which
the engines' text leaves out: the conversation sent back then renders to the tokens sampled. The
recorded turn keeps the engine's text, which ends after the stop string, like the token ids.

A special token here is any added token marked special, what ``decode(skip_special_tokens=True)``
leaves out; ``tokenizer.all_special_ids`` names only some of them (bos, eos, pad and the tokens the
tokenizer config lists), not every end token a model may stop on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from raylign.rollout.base import Completion


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's special tokens: those that ``decode(..., skip_special_tokens=True)`` leaves out."""

    ids: frozenset[int]
    pattern: re.Pattern[str] | None  # matches any of their texts, longest first

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialTokens:
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        texts = sorted(set(added.values()), key=len, reverse=True)
        return cls(frozenset(added), re.compile("|".join(map(re.escape, texts))) if texts else None)


def ending_stop_string(completion: Completion, stop: list[str]) -> str | None:
    """The stop string that ended ``completion``: the first of ``stop`` that its text ends with, when it
    finished on a stop; None otherwise."""
    if completion.finish_reason != "stop":
        return None
    return next((s for s in stop if s and completion.text.endswith(s)), None)


def client_text(tokenizer: Any, special: SpecialTokens, completion: Completion, stop: list[str]) -> str:
    """The text as OpenAI returns it, without the stop string or end-of-sequence token that ended it,
    with the special tokens sampled before it put back (module docstring). When the sampled tokens,
    decoded with their special tokens, do not spell the engine's text once those are taken out (a
    tokenizer that cleans up spaces, bytes of a character split by a special token), the engine's
    text is returned as it is."""
    ended_on = ending_stop_string(completion, stop)
    plain = completion.text[: -len(ended_on)] if ended_on else completion.text
    ids = list(completion.response_token_ids)
    if completion.finish_reason == "stop" and ids and ids[-1] in special.ids:
        ids.pop()  # the end-of-sequence token: the chat template writes the turn's end itself
    if special.pattern is None or not special.ids.intersection(ids):
        return plain
    full = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return with_special_tokens(full, plain, special.pattern) or plain


def hidden_tail(tokenizer: Any, special: SpecialTokens, completion: Completion, stop: list[str]) -> int:
    """How many of the response's last tokens the text returned to the client (:func:`client_text`)
    does not hold whole: the end-of-sequence token, or the tokens from the one where the stop string
    that ended it begins (the engines cut their text right after the stop string, which may end inside
    a token). 0 when nothing was left out: the next prompt must then go on from every token."""
    ids = list(completion.response_token_ids)
    if completion.finish_reason != "stop" or not ids:
        return 0
    if ids[-1] in special.ids:
        return 1
    ended_on = ending_stop_string(completion, stop)
    if ended_on is None:
        return 0
    shown = completion.text[: -len(ended_on)]
    whole = next(
        k for k in range(len(ids), -1, -1) if shown.startswith(tokenizer.decode(ids[:k], skip_special_tokens=True))
    )
    return len(ids) - whole


def with_special_tokens(full: str, plain: str, special: re.Pattern[str]) -> str | None:
    """``plain`` with the special tokens of ``full`` where they are in it: ``full`` read up to where
    ``plain`` ends (a stop string may follow), and the special tokens right after. None when
    ``full`` without its special tokens does not begin with ``plain``."""
    kept, i, j = [], 0, 0
    while i < len(full):
        token = special.match(full, i)
        if token:
            kept.append(token.group())
            i = token.end()
        elif j < len(plain) and full[i] == plain[j]:
            kept.append(full[i])
            i, j = i + 1, j + 1
        else:
            break
    return "".join(kept) if j == len(plain) else None
