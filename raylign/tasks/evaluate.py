"""Greedy answers from a saved model, for checking tasks with known answers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@torch.no_grad()
def greedy_chat_answers(
    model_dir: str | Path, prompts: list[str], max_new_tokens: int = 16, batch_size: int = 32
) -> list[str]:
    """Greedy replies of the model in ``model_dir`` to single-turn chat prompts."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    replies: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in chunk
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = out[:, enc["input_ids"].shape[1] :]
        replies.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    return replies
