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
