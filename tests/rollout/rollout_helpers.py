"""Independent references for the rollout tests: plain loops over a separate fp32 forward."""

from __future__ import annotations

import glob
import os

import torch

from raylign.cluster import ray_session_logs


def load_fp32(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def perturb_(model, scale: float = 0.05, seed: int = 123) -> None:
    """Add seeded noise to every parameter, as an optimizer step would change them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)


def keep_mask(logits: torch.Tensor, top_k: int, top_p: float) -> list[bool]:
    """Which tokens survive top-k then top-p, by a plain loop over the sorted vocabulary."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    if top_k > 0:
        order = order[:top_k]
    probs = torch.softmax(logits[order].double(), dim=-1).tolist()
    kept, mass = [], 0.0
    for token, p in zip(order, probs):
        kept.append(token)
        mass += p
        if mass >= top_p:
            break
    mask = [False] * len(logits)
    for token in kept:
        mask[token] = True
    return mask


def reference_logprobs(
    model, prompt: list[int], response: list[int], temperature: float = 0.0, top_k: int = -1, top_p: float = 1.0
) -> list[float]:
    """log_softmax(filter_{k,p}(logits / T))[token] from one fp32 forward over prompt + response."""
    if not response:
        return []
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double()
    out = []
    for step, token in enumerate(response):
        row = logits[len(prompt) - 1 + step]
        if temperature > 0:
            row = row / temperature
            mask = torch.tensor(keep_mask(row, top_k, top_p))
            row = row.masked_fill(~mask, float("-inf"))
        out.append(float(torch.log_softmax(row, dim=-1)[token]))
    return out


def prefix_until_stop(tokenizer, tokens: list[int], stop: str) -> tuple[list[int], str]:
    """The shortest token prefix whose decoded text contains ``stop``, and that text cut right after it."""
    for end in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:end], skip_special_tokens=True)
        if stop in text:
            return tokens[:end], text[: text.index(stop) + len(stop)]
    raise AssertionError(f"{stop!r} never appears")


def pick_stop_string(tokenizer, tokens: list[int]) -> str:
    """A two-character stop string that first appears in the middle of the decoded tokens."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for start in range(len(text) // 3, len(text) - 2):
        candidate = text[start : start + 2]
        if "\ufffd" in candidate or not candidate.strip():
            continue
        prefix, _ = prefix_until_stop(tokenizer, tokens, candidate)
        if 2 <= len(prefix) < len(tokens):
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


def worker_log_paths() -> list[str]:
    """The logs of this Ray session's workers, which hold the engines' output (and their vLLM workers')."""
    logs = ray_session_logs()
    assert logs is not None, "no Ray session logs to read"
    return glob.glob(os.path.join(logs, "worker-*.out")) + glob.glob(os.path.join(logs, "worker-*.err"))


def worker_log_sizes() -> dict[str, int]:
    return {path: os.path.getsize(path) for path in worker_log_paths()}


def reload_warnings(since: dict[str, int]) -> list[str]:
    """vLLM's "<layer>: Failed to load weights" lines written to the workers' logs after ``since`` (their
    sizes then). vLLM writes it for a layer whose weights a reload did not receive; a rotary embedding never
    gets any (its cos/sin cache is computed, and vLLM keeps it), so the engines leave that one out: otherwise
    every sync would warn of a failure that is not one. Only what this sync wrote counts: other tests in the
    same Ray session end syncs midway on purpose, and their engines rightly warn."""
    lines = []
    for path in worker_log_paths():
        with open(path, "rb") as f:
            f.seek(since.get(path, 0))
            text = f.read().decode(errors="replace")
        lines += [line.strip() for line in text.splitlines() if "Failed to load weights" in line]
    return lines
