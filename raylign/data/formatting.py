"""Token-level building blocks shared by dataset kinds: plain prompt/response encoding and truncation."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from raylign.data.errors import DataError


def encode_plain(
    tokenizer: PreTrainedTokenizerBase, prompt_text: str, response_text: str | None, add_eos: bool
) -> tuple[list[int], int]:
    """Ids of ``prompt_text`` followed by ``response_text`` (+ eos), and the prompt's length in tokens.

    Prompt and response are tokenised separately, so the prompt's tokens are exactly those a
    generation request for this prompt sees; only the prompt gets the tokenizer's special
    tokens (a BOS, for tokenizers that add one).
    """
    prompt_ids = list(tokenizer(prompt_text, add_special_tokens=True)["input_ids"])
    response_ids = []
    if response_text is not None:
        response_ids = list(tokenizer(response_text, add_special_tokens=False)["input_ids"])
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise DataError("data.add_eos is set but the tokenizer has no eos token")
        response_ids.append(tokenizer.eos_token_id)
    return prompt_ids + response_ids, len(prompt_ids)


def truncate_prompt_response(
    ids: list[int], mask: list[int], prompt_len: int, max_length: int, min_response_tokens: int
) -> tuple[list[int], list[int]]:
    """Cut a sequence to ``max_length`` keeping the end of the prompt and the start of the response.

    The prompt (``ids[:prompt_len]``) keeps at most ``max_length - min(response_len, min_response_tokens)``
    of its last tokens; the response then keeps as many of its first tokens as fit.
    """
    response_len = len(ids) - prompt_len
    keep_prompt = min(prompt_len, max_length - min(response_len, min_response_tokens))
    keep_response = min(response_len, max_length - keep_prompt)
    start, end = prompt_len - keep_prompt, prompt_len + keep_response
    return ids[start:end], mask[start:end]
