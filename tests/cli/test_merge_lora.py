"""``raylign merge-lora``, and the adapter folder a LoRA model's export writes beside its merged weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from raylign.cli.main import main
from raylign.cli.merge_lora import MergeLoraConfig, run_merge_lora
from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine


def trained_lora(model_dir):
    """A PEFT LoRA model on ``model_dir`` with random B matrices, as after training."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def test_an_exported_adapter_merges_into_the_model_the_export_holds(tied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = trained_lora(tied_model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 40, 41]])
    with torch.no_grad():
        expected_logits = model(ids).logits
    engine = create_engine(model, EngineConfig(backend="local"), OptimConfig(lr=1e-3), 1)
    engine.export_hf(tmp_path / "final", AutoTokenizer.from_pretrained(str(tied_model_dir)))
    adapter = tmp_path / "final" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tied_model_dir) and config["r"] == 4
    assert len(load_file(adapter / "adapter_model.safetensors")) == 2 * 3 * 2  # A, B x 3 modules x 2 layers

    assert main(["merge-lora", "--adapter", str(adapter), "--output_dir", str(tmp_path / "merged")]) == 0
    # Two merges made independently (raylign's export, PEFT's merge_and_unload) hold the same weights,
    # and the merged model computes what the adapter on its base computes.
    exported = load_file(tmp_path / "final" / "model.safetensors")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert exported.keys() == merged.keys()
    for name, value in exported.items():
        torch.testing.assert_close(merged[name], value, atol=1e-6, rtol=0, msg=name)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected_logits, atol=1e-5, rtol=0)
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()


def test_merge_lora_names_what_is_missing(tied_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing/adapter_config.json: no such file"):
        run_merge_lora(MergeLoraConfig(adapter=str(tmp_path / "nothing"), output_dir=str(tmp_path / "out")))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    # Without its weights PEFT would look for them on the hub and say only that it could not reach it.
    with pytest.raises(FileNotFoundError, match=r"adapter/adapter_model.safetensors: no such file \(nor adapter_model"):
        run_merge_lora(MergeLoraConfig(adapter=str(adapter), output_dir=str(tmp_path / "out")))
    (adapter / "adapter_model.safetensors").write_bytes(b"")  # read only after the checks below
    with pytest.raises(ValueError, match="names no base_model_name_or_path; give the base model with --base"):
        run_merge_lora(MergeLoraConfig(adapter=str(adapter), output_dir=str(tmp_path / "out")))
    with pytest.raises(FileNotFoundError, match="missing-base"):
        run_merge_lora(
            MergeLoraConfig(adapter=str(adapter), base=str(tmp_path / "missing-base"), output_dir=str(tmp_path / "o"))
        )
    # A damaged config is named, whether or not the base is given (the head check reads it too).
    for text, problem in [
        (
            '{"base_model_name_or_path": "x",',
            "not valid JSON: Expecting property name enclosed in double quotes at line 1, column 33",
        ),
        ('["x"]', "must hold a JSON object, got list"),
    ]:
        (adapter / "adapter_config.json").write_text(text)
        for base in (None, str(tied_model_dir)):
            with pytest.raises(ValueError) as err:
                run_merge_lora(MergeLoraConfig(adapter=str(adapter), base=base, output_dir=str(tmp_path / "out")))
            assert str(err.value) == f"{adapter / 'adapter_config.json'}: {problem}"
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_merge_lora_refuses_an_output_path_it_cannot_write_and_a_base_the_adapter_does_not_fit(
    tied_model_dir, tmp_path
):
    from raylign.models.tiny import build_tiny_model

    adapter = tmp_path / "adapter"
    trained_lora(tied_model_dir).save_pretrained(adapter)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    # The merge went ahead, transformers only logged that it wrote nothing, and the command said "written".
    with pytest.raises(NotADirectoryError, match="output_dir '.*a_file' is a file, not a folder"):
        run_merge_lora(MergeLoraConfig(adapter=str(adapter), base=str(tied_model_dir), output_dir=str(a_file)))
    assert a_file.read_text() == ""
    narrower = build_tiny_model(tmp_path / "narrower", hidden_size=32, num_layers=2, seed=1)
    # It was torch's whole load_state_dict traceback.
    with pytest.raises(
        ValueError, match=r"the adapter .*adapter does not fit the base model .*narrower: size mismatch"
    ):
        run_merge_lora(MergeLoraConfig(adapter=str(adapter), base=str(narrower), output_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()  # made to check it can be written, removed with the refusal


def embedding_adapter(model_dir, folder):
    """A PEFT adapter on ``model_dir``'s embedding (and q_proj), saved to ``folder``, with random values in
    both its matrices; returns the adapted model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(str(folder))
    return model


def untied_copy(model_dir, folder):
    """``model_dir``'s model with its output head saved as a copy of the embedding, untied."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(str(folder))
    return folder


def test_merge_lora_refuses_an_adapter_on_a_tied_embedding(tied_model_dir, tmp_path):
    """Merged into a tied model, the adapted embedding would serve as the output head, which the adapter on its
    base computes from the unadapted embedding: the merged model would be another model."""
    embedding_adapter(tied_model_dir, tmp_path / "adapter")
    cfg = MergeLoraConfig(adapter=str(tmp_path / "adapter"), output_dir=str(tmp_path / "merged"))
    with pytest.raises(ValueError, match=r"LoRA adapts embed_tokens .*adapter_config\.json.*tie_word_embeddings"):
        run_merge_lora(cfg)
    assert not (tmp_path / "merged").exists()


def test_an_embedding_adapter_merged_onto_an_untied_copy_computes_what_it_computes_on_its_tied_base(
    tied_model_dir, tmp_path
):
    """What the refusal advises: the untied copy keeps the base embedding as the head, as PEFT's forward does."""
    from transformers import AutoModelForCausalLM

    model = embedding_adapter(tied_model_dir, tmp_path / "adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9, 40, 41]])
    with torch.no_grad():
        expected_logits = model(ids).logits
    base = untied_copy(tied_model_dir, tmp_path / "untied")
    run_merge_lora(MergeLoraConfig(adapter=str(tmp_path / "adapter"), base=str(base), output_dir=str(tmp_path / "m")))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected_logits, atol=1e-5, rtol=0)


def reward_model_lora(model_dir, folder, num_labels=1):
    """A PEFT LoRA reward model on ``model_dir`` (a ``score`` head of ``num_labels`` outputs, trained whole
    beside the adapters, as in ``raylign rm`` and ``raylign prm``) with random adapter and head values, saved
    to ``folder``; returns the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), num_labels=num_labels, dtype=torch.float32
    )
    base.config.pad_token_id = AutoTokenizer.from_pretrained(str(model_dir)).pad_token_id
    model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(folder), save_embedding_layers=False)
    return model.eval()


def test_a_reward_model_adapter_merges_into_a_reward_model_with_its_trained_head(tied_model_dir, tmp_path):
    """The adapter of a LoRA reward model carries the score head it trained: the merged folder is a reward
    model that scores as the adapter on its base does, padded batches included (its config names the pad)."""
    from transformers import AutoModelForSequenceClassification

    model = reward_model_lora(tied_model_dir, tmp_path / "adapter")
    sequences = [[5, 6, 7, 8, 9, 40, 41], [12, 13, 14]]
    with torch.no_grad():  # each sequence alone, no padding
        expected = torch.cat([model(input_ids=torch.tensor([ids])).logits[:, 0] for ids in sequences])
    run_merge_lora(MergeLoraConfig(adapter=str(tmp_path / "adapter"), output_dir=str(tmp_path / "merged")))

    merged, info = AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"]  # the trained head is in the folder
    assert merged.config.num_labels == 1
    pad = merged.config.pad_token_id
    padded = torch.tensor([sequences[0], sequences[1] + [pad] * 4])
    with torch.no_grad():
        scores = merged.eval()(input_ids=padded, attention_mask=(padded != pad).long()).logits[:, 0]
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)


def test_a_process_reward_model_adapter_merges_into_one_that_scores_every_step_as_the_adapter_does(
    tied_model_dir, tmp_path
):
    """A PRM's adapter (two labels: a step is wrong or right, scored at every position): the merged folder
    loads with ``load_prm`` and gives the adapter model's logits at every token."""
    from raylign.models import token_scores
    from raylign.trainers.prm import NUM_CLASSES, load_prm

    model = reward_model_lora(tied_model_dir, tmp_path / "adapter", num_labels=NUM_CLASSES)
    ids = torch.tensor([[5, 6, 7, 8, 9, 40, 41, 12, 13]])
    with torch.no_grad():
        expected = token_scores(model, ids)
    run_merge_lora(MergeLoraConfig(adapter=str(tmp_path / "adapter"), output_dir=str(tmp_path / "merged")))

    merged, _ = load_prm(tmp_path / "merged")
    assert merged.config.num_labels == NUM_CLASSES
    with torch.no_grad():
        scores = token_scores(merged, ids)
    assert scores.shape == (1, ids.shape[1], NUM_CLASSES)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
