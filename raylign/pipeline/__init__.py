"""The offline data pipeline: generate -> score -> select -> train.

Each step reads the previous step's JSONL file and writes its own (atomically: a ``.tmp``
file renamed when complete), so a step can be rerun alone.

``raylign generate`` (:mod:`raylign.pipeline.generate`) writes one row per prompt::

    {"prompt": <the dataset's prompt: text or [{role, content}, ...]>,
     "prompt_text": <the prompt as the model saw it: chat template or prompt_template applied>,
     "responses": [<n response texts>],
     "finish_reasons": [<"stop" | "length" per response>],
     "label": <the dataset's label, or null>,
     "data_source": <the row's data_source, else the prompt file's name without its suffix>,
     ...<passthrough keys of the dataset row>}

``raylign score`` (:mod:`raylign.pipeline.score`) adds to every row::

    "rewards": [<combined reward per response>],
    "reward_metrics": {<source name or source/metric>: [<value per response>]}

``raylign select`` (:mod:`raylign.pipeline.select`) writes SFT rows
``{"prompt", "completion", "reward"}`` (plus ``"messages"`` when the prompt is a conversation)
and preference pairs ``{"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward",
"margin"}``, which ``raylign sft`` and ``raylign dpo`` read with their default keys.
"""
