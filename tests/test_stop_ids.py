"""Where a generation ends (run.model.stop_ids): the tokenizer's EOS and every EOS id of the
model's generation_config.json, as transformers' generate() and vLLM stop at them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from repaudit import builtin
from repaudit.errors import InputError
from repaudit.run.model import stop_ids


@pytest.mark.parametrize("config, tokenizer_eos, expected", [
    ({"eos_token_id": [151645, 151643]}, 151645, (151643, 151645)),  # a chat model: end of turn, end of text
    ({"eos_token_id": 2}, 2, (2,)),
    ({"eos_token_id": 2}, 7, (2, 7)),
    ({"bos_token_id": 1}, 7, (7,)),
    (None, 7, (7,)),
    (None, None, ()),
    ({"eos_token_id": [3, None]}, None, (3,)),
])
def test_stop_ids_are_the_tokenizers_eos_and_the_generation_configs(tmp_path, config, tokenizer_eos, expected):
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert stop_ids(tmp_path, SimpleNamespace(eos_token_id=tokenizer_eos)) == expected


def test_a_generation_config_that_is_not_json_is_refused_in_one_line(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(InputError, match="generation_config.json: not readable as JSON") as err:
        stop_ids(tmp_path, SimpleNamespace(eos_token_id=1))
    assert "\n" not in str(err.value)


def test_the_built_in_models_stop_where_their_tokenizer_does():
    from repaudit.run.model import ModelRef, load_tokenizer

    path = builtin.ensure("builtin:tiny-qwen3")
    tok = load_tokenizer(ModelRef("builtin:tiny-qwen3", path, None), False)
    assert stop_ids(path, tok) == (tok.eos_token_id,)


@pytest.mark.parametrize("config, expected", [
    ({"eos_token_id": 5}, (5, 7)),
    ({"eos_token_id": [5, 6]}, (5, 6, 7)),
    ({"text_config": {"eos_token_id": 9}}, (7, 9)),  # a multimodal checkpoint: its decoder's
    ({"eos_token_id": 5, "text_config": {"eos_token_id": 9}}, (5, 7)),
    ({"eos_token_id": None}, (7,)),
])
def test_without_a_generation_config_the_model_configs_eos_ids_stop(tmp_path, config, expected):
    """transformers builds the generation config from config.json where generation_config.json
    is absent (GenerationConfig.from_model_config), and generate() stops at its EOS ids; these
    used to be left out."""
    from transformers import GenerationConfig

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert stop_ids(tmp_path, SimpleNamespace(eos_token_id=7)) == expected
    theirs = GenerationConfig.from_pretrained(tmp_path, config_file_name="config.json", _from_model_config=True)
    eos = theirs.eos_token_id
    assert set(expected) == {7} | set([eos] if isinstance(eos, int) else eos or [])


def test_a_generation_ends_where_generate_ends_it_without_a_generation_config(tmp_path):
    """End to end: a checkpoint whose only EOS is config.json's; the engine's record ends at the
    token where model.generate() ends, and holds generate()'s tokens and logprobs bit for bit."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from repaudit.engines import hf
    from repaudit.engines.base import Sequence

    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
                      pad_token_id=0, eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    prompt = [11, 200, 37, 90, 5, 61]
    with torch.inference_mode():
        free = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    end = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a generation of 3 or more tokens
    eos = free[end]
    model.config.eos_token_id = eos
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()

    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = plain.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    want = out.sequences[0, len(prompt):].tolist()
    assert want == free[: end + 1]  # generate() stopped at config.json's EOS

    stops = stop_ids(tmp_path, SimpleNamespace(eos_token_id=None))
    hfm = hf.load(str(tmp_path), dtype="float32", device="cpu", tp=1, stop_ids=stops, pad_id=0)
    (rows,), _ = hf.generate(hfm, [Sequence("p", tuple(prompt), None, 8)], topk=0)
    assert rows.token_id.tolist() == want
    lp = torch.log_softmax(torch.cat(out.logits).float(), -1)[torch.arange(len(want)), torch.tensor(want)]
    assert np.array_equal(rows.logprob.view(np.uint32), lp.numpy().view(np.uint32))
