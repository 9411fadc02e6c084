"""Load a model folder in vLLM and print greedy tokens with their log-probs as JSON (run by the tests).

A separate process, so vLLM's process-wide settings never touch the test session.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams

    folder, prompt = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(folder, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 << 20, max_model_len=128)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params)
    completion = output.outputs[0]
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
    print("RESULT " + json.dumps({"tokens": list(completion.token_ids), "logprobs": logprobs}))


if __name__ == "__main__":
    main()
