"""Conformance of the transformers engine's logprobs with the model's own logits.

A recorded logprob must be, by construction, log_softmax of the logits the model itself
returns: `log_softmax(model(ids).logits.float())`, with whatever the family does after lm_head
(Granite's logits_scaling, Gemma's final_logit_softcapping, Cohere's logit_scale, MiniCPM3's
scaling of the hidden states, ...). For every decoder family in transformers that has a TP
plan (its config class defines base_model_tp_plan) and an AutoModelForCausalLM class, this
builds a tiny random model (fp32, fixed seed), loads it with the engine (TP=1, CPU, stock
kernels), runs score and generate at batch size 1, and compares the records bit for bit with
the model's own forward on the same single sequence:

- score: `model(ids).logits` of the whole sequence, a plain forward;
- generate: the model's own forward fed the inputs the engine gives its base model, with a KV
  cache: the prefill's logits for the prompt positions, then step by step with
  logits_to_keep=1 (what `generate()` does) for the new tokens.

Bitwise on CPU holds only where both sides run lm_head on the same shapes (a GEMM's row bits
depend on M, the number of rows): the engine's head runs as the model's forward on one
sequence does (repaudit/engines/hf_head.py), and test_head_runs_on_the_shapes_of_the_models_forward
pins that with sequences of 2 and 3 tokens, where a 1- or 2-row product gives other bits.

`hf.VERIFIED_FAMILIES` (what cfg_check accepts) must equal the families this file proves.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from repaudit.record.digest import row_digest, to_uint64  # noqa: E402
from repaudit.engines import hf, hf_decode  # noqa: E402
from repaudit.engines.base import Sequence  # noqa: E402
from repaudit.errors import InputError  # noqa: E402

VOCAB = 512
SEED = 1234
TOPK = 3

# Small sizes, applied to every config field of that name the family has.
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    # mixture of experts
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    index_n_heads=4, index_head_dim=16,
)

# Family-specific fields: sizes the generic shrinking does not cover, layer patterns that must
# keep one layer of each kind, and final logit transforms that the defaults leave off (so the
# test exercises them: logits_scaling, final_logit_softcapping, logit_scale, a padded vocabulary).
SPECIAL: dict[str, dict] = {
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                    "mrope_section": [3, 3, 2]}}, logit_scale=0.25),
    "gemma3_text": dict(final_logit_softcapping=5.0),
    "granite": dict(logits_scaling=4.0),
    "granite_swa": dict(logits_scaling=4.0),
    "granitemoe_swa": dict(logits_scaling=4.0),
    "inkling_text": dict(unpadded_vocab_size=VOCAB - 12),
    "gemma3n_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                         num_kv_shared_layers=2, intermediate_size=[128] * 4,
                         activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], vocab_size_per_layer_input=VOCAB,
                         hidden_size_per_layer_input=16, laurel_rank=8),
    "gemma4_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                        per_layer_config={"01": {"head_dim": 32}}, final_logit_softcapping=5.0),
    "gemma4_unified_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                                per_layer_config={"01": {"head_dim": 32}}, final_logit_softcapping=5.0),
    # No window, so that the static-cache decode (which Mistral's default 4096-token window
    # rules out: engines/hf_decode.static_supported) is checked for the family too.
    "mistral": dict(sliding_window=None),
    "kimi_linear": dict(num_experts_per_token=2, linear_head_dim=16, linear_num_heads=4),
    "longcat_flash": dict(num_layers=1, ffn_hidden_size=128, expert_ffn_hidden_size=32, moe_topk=2, zero_expert_num=2),
    "phi4_multimodal": dict(audio_config=dict(num_blocks=2, nemo_conv_channels=64, ext_pw_out_channel=64,
                                              depthwise_separable_out_channel=64)),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=64,
                           indexer_compress_ratio=4, hc_lowrank=8, linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4),
}

# Families with a TP plan and a CausalLM class that this file does not run, each with its reason.
SKIPPED: dict[str, str] = {
    "minimax": "MiniMaxModel accepts only its own MiniMaxCache; the engine's generate passes a DynamicCache",
}
MAX_SKIPPED = 4
MAX_PARAMS = 5_000_000  # a tiny config must stay tiny: checked on the meta device before any allocation


def _families() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            out.append(model_type)
    return sorted(out)


# Parametrised from the engine's list, not from the scan: the scan imports transformers' model
# classes, which import triton, and this module is imported at collection, before the modules
# that run Triton's CPU interpreter have switched it on. The scan runs inside a test instead
# (test_the_verified_families_are_the_scanned_ones) and must agree with this list.
TESTED = sorted(hf.VERIFIED_FAMILIES)


def _shrink(full: dict) -> dict:
    """Small values for a config's fields, given the defaults as a dict (sub-configs recursively)."""
    layers = full.get("num_hidden_layers")
    kw = {k: v for k, v in SMALL.items() if k in full}
    per_layer = {k: v for k, v in full.items() if isinstance(v, (list, tuple)) and layers and len(v) == layers}
    n = 2
    for v in per_layer.values():  # keep one layer of each kind (sliding/full, dense/sparse, ...), at most 4
        try:
            n = max(n, min(4, len(dict.fromkeys(v))))
        except TypeError:
            pass
    if layers:
        kw["num_hidden_layers"] = n
    for k, v in per_layer.items():
        if k in SMALL:
            kw[k] = [SMALL[k]] * n
            continue
        try:
            kinds = list(dict.fromkeys(v))
        except TypeError:
            kinds = list(v[:n])
        kw[k] = (kinds + [kinds[-1]] * n)[:n]
    for k, v in full.items():
        if isinstance(v, dict) and "model_type" in v:  # a sub-config (text, vision, audio)
            kw[k] = {**v, **_shrink(v)}
    if "qk_rope_head_dim" in full:  # MLA: head_dim is the rope part, one KV head per query head
        kw["head_dim"] = SMALL["qk_rope_head_dim"]
        kw["num_key_value_heads"] = SMALL["num_attention_heads"]
        if "qk_head_dim" in full:
            kw["qk_head_dim"] = SMALL["qk_rope_head_dim"] + SMALL["qk_nope_head_dim"]
    return kw


def tiny_config(model_type: str, **extra):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    kw = _shrink(config_class().to_dict())
    for k, v in SPECIAL.get(model_type, {}).items():
        kw[k] = {**kw[k], **v} if isinstance(v, dict) and isinstance(kw.get(k), dict) and "model_type" in kw[k] else v
    kw.update(initializer_range=0.1, pad_token_id=0, **extra)  # 0.1: peaked distributions, not near-uniform ones
    return config_class(**kw)


def _save_tiny(model_type: str, path, **extra) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = tiny_config(model_type, **extra)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert n <= MAX_PARAMS, f"{model_type}: the tiny config has {n} parameters; shrink it in SPECIAL"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)


def _sequences(seed: int) -> list[tuple[list[int], list[int]]]:
    g = np.random.default_rng(seed)
    return [(g.integers(1, VOCAB, 7).tolist(), g.integers(1, VOCAB, 5).tolist()),
            (g.integers(1, VOCAB, 4).tolist(), g.integers(1, VOCAB, 8).tolist())]


@torch.inference_mode()
def _reference(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own fp32 logits for a plain forward on one sequence, and their log-softmax."""
    logits = model(torch.tensor([ids])).logits.float()[0]
    return logits, torch.log_softmax(logits, dim=-1)


@torch.inference_mode()
def _reference_cached(model, prompt: list[int], new: list[int], static: bool = False) -> torch.Tensor:
    """The model's own fp32 logits for each new token as a generation computes them, fed the
    inputs the engine gives its base model (mask, positions, a KV cache the model makes itself),
    step by step with logits_to_keep=1, as generate() does. The prefill runs with the cache:
    some families' base models give other bits with a cache than without (Inkling).
    static: transformers' StaticCache of prompt + new - 1 slots (generate's max_length - 1), the
    mask over all of them (what generate(cache_implementation="static") gives the model)."""
    from transformers import StaticCache

    def step(ids, mask, positions, cache, keep):
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=True, logits_to_keep=keep)

    ids = torch.tensor([prompt])
    slots = len(prompt) + len(new) - 1
    mask = torch.zeros((1, slots), dtype=torch.long) if static else torch.ones_like(ids)
    mask[:, : len(prompt)] = 1
    positions = torch.arange(len(prompt))[None]
    out = step(ids, mask, positions, StaticCache(config=model.config, max_cache_len=slots) if static else None, 1)
    rows = [out.logits.float()[0, -1]]
    for i, tok in enumerate(new[:-1]):
        if static:
            mask[:, len(prompt) + i] = 1
        else:
            mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = step(torch.tensor([[tok]]), mask, positions, out.past_key_values, 1)
        rows.append(out.logits.float()[0, -1])
    return torch.stack(rows)


def _check_rows(what: str, rows, logits: torch.Tensor, lp: torch.Tensor, tokens: np.ndarray) -> None:
    want = lp[torch.arange(len(tokens)), torch.from_numpy(tokens.astype(np.int64))].numpy()
    bad = np.flatnonzero(_bits(rows.logprob) != _bits(want))
    assert bad.size == 0, (f"{what}: {bad.size}/{len(want)} logprobs differ from log_softmax(model(ids).logits); "
                           f"first at pos {int(rows.pos[bad[0]])}: {rows.logprob[bad[0]]!r} != {want[bad[0]]!r}")
    assert np.array_equal(rows.digest, to_uint64(row_digest(logits))), f"{what}: logits rows differ (row digest)"
    assert np.array_equal(rows.top1, logits.argmax(-1).numpy()), f"{what}: top-1 differs"


def _conform(model_type: str, path, seed: int = 0) -> None:
    """Score (two sequences, top-k on) and generate (one prompt, 3 new tokens) with the engine,
    each record checked against the model's own logits."""
    hfm = hf.load(str(path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    sequences = _sequences(seed)
    for i, (prompt, completion) in enumerate(sequences):
        seq = prompt + completion
        logits, lp = _reference(hfm.model, seq)
        (rows,), _ = hf.score(hfm, [Sequence(f"s{i}", tuple(prompt), tuple(completion), 0)], topk=TOPK)
        assert rows.pos.tolist() == list(range(1, len(seq)))
        _check_rows(f"{model_type} score s{i}", rows, logits[:-1], lp[:-1], np.asarray(seq[1:]))
        want_lp, want_ids = torch.topk(lp[:-1], TOPK, dim=-1)
        assert np.array_equal(rows.topk_ids, want_ids.numpy()), f"{model_type} score s{i}: top-k ids differ"
        assert np.array_equal(_bits(rows.topk_logprobs), _bits(want_lp.numpy())), \
            f"{model_type} score s{i}: top-k logprobs differ"

    prompt = sequences[0][0]
    for decode in ("dynamic", "static") if hf_decode.static_supported(hfm.model) else ("dynamic",):
        hfm.decode = decode
        (rows,), _ = hf.generate(hfm, [Sequence("g", tuple(prompt), None, 3)], topk=0)
        new = rows.token_id.tolist()
        assert len(new) == 3 and rows.pos.tolist() == [len(prompt), len(prompt) + 1, len(prompt) + 2]
        d_logits = _reference_cached(hfm.model, prompt, new, static=decode == "static")
        what = f"{model_type} generate ({decode} cache)"
        assert new == d_logits.argmax(-1).tolist(), f"{what}: greedy tokens differ"
        _check_rows(f"{what}, new tokens", rows, d_logits, torch.log_softmax(d_logits, dim=-1), np.asarray(new))


@pytest.mark.parametrize("model_type", sorted(hf_decode.STATIC_FAMILIES))
def test_the_static_decode_families_are_tested(model_type, tmp_path):
    """Each family that may decode over a static cache gets that path checked above: its tiny
    model here must take it (a window or another attention would silently skip the check)."""
    assert model_type in TESTED, "a family decodes with a static cache that nothing here checks"
    _save_tiny(model_type, tmp_path)
    hfm = hf.load(str(tmp_path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    assert hf_decode.static_supported(hfm.model)


# ----------------------------------------------------------------------------- the families


@pytest.mark.parametrize("model_type", TESTED)
def test_family_logprobs_are_the_models_own(model_type, tmp_path):
    _save_tiny(model_type, tmp_path)
    _conform(model_type, tmp_path)


def test_the_verified_families_are_the_scanned_ones():
    FAMILIES = _families()
    assert len(FAMILIES) > 50, "the scan for families with a TP plan found too few; is it broken?"
    assert set(SKIPPED) <= set(FAMILIES), sorted(set(SKIPPED) - set(FAMILIES))
    assert len(SKIPPED) <= MAX_SKIPPED, SKIPPED
    tested = set(FAMILIES) - set(SKIPPED)
    # What cfg_check accepts is exactly what this file proves: a new family is refused until it runs here.
    assert hf.VERIFIED_FAMILIES == tested, {"not verified yet": sorted(tested - hf.VERIFIED_FAMILIES),
                                            "verified but not tested": sorted(hf.VERIFIED_FAMILIES - tested)}


# ----------------------------------------------------------------------------- the defect


def test_granite_logits_scaling_is_applied(tmp_path):
    """The reproduction of the defect: Granite divides its logits by logits_scaling; the records
    used to take log_softmax(lm_head(h)) and were off by up to a nat while greedy tokens agreed."""
    _save_tiny("granite", tmp_path, logits_scaling=8.0)
    hfm = hf.load(str(tmp_path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    assert hfm.model.config.logits_scaling == 8.0
    _conform("granite", tmp_path, seed=1)
    # The old formula is far from the model's own: the bitwise checks above are not vacuous here.
    prompt, completion = _sequences(1)[0]
    ids = torch.tensor([prompt + completion])
    with torch.inference_mode():
        hidden = hfm.model.base_model(input_ids=ids).last_hidden_state
        old = torch.log_softmax(hfm.model.lm_head(hidden).float(), dim=-1)
    _, own = _reference(hfm.model, ids[0].tolist())
    assert (old[0] - own).abs().max(dim=-1).values.median() > 0.1


@pytest.mark.parametrize("model_type", ["gemma2", "vaultgemma"])
def test_attention_soft_capping_is_applied(model_type, tmp_path):
    """Gemma 2 and VaultGemma cap their attention logits; transformers' default sdpa attention
    drops the cap without a word, so the engine loads them with eager attention: the records are
    the logprobs of an eager forward, bit for bit, and far from sdpa's."""
    from transformers import AutoModelForCausalLM

    _save_tiny(model_type, tmp_path, attn_logit_softcapping=1.0)
    hfm = hf.load(str(tmp_path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    assert hfm.model.config._attn_implementation == "eager"
    prompt, completion = _sequences(2)[0]
    seq = prompt + completion
    for name, p in hfm.model.named_parameters():  # q/k scaled up: the cap bites
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            p.data.mul_(6.0)
    (rows,), _ = hf.score(hfm, [Sequence("s", tuple(prompt), tuple(completion), 0)], topk=0)
    logits, lp = _reference(hfm.model, seq)
    _check_rows(f"{model_type} score", rows, logits[:-1], lp[:-1], np.asarray(seq[1:]))
    sdpa = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="sdpa")
    sdpa.load_state_dict(hfm.model.state_dict())
    _, sdpa_lp = _reference(sdpa, seq)
    assert (sdpa_lp - lp).abs().max() > 1e-2  # what the records would have been


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("model_type", ["llama", "granite"])
def test_head_runs_on_the_shapes_of_the_models_forward(model_type, tmp_path):
    """A row's bits depend on how many rows share lm_head's GEMM: on CPU a sequence of 2 tokens
    gives a 1-row product in the engine if it keeps only the rows it records, a 2-row one in
    model(ids), and the bits differ. The engine runs the head on every position of a sequence."""
    _save_tiny(model_type, tmp_path)
    hfm = hf.load(str(tmp_path), dtype="float32", device="cpu", tp=1, stop_ids=(), pad_id=0)
    for n in (2, 3):
        seq = list(range(11, 11 + n))
        logits, lp = _reference(hfm.model, seq)
        (rows,), _ = hf.score(hfm, [Sequence("s", (seq[0],), tuple(seq[1:]), 0)], topk=0)
        _check_rows(f"{model_type} score of {n} tokens", rows, logits[:-1], lp[:-1], np.asarray(seq[1:]))
        (rows,), _ = hf.generate(hfm, [Sequence("g", tuple(seq), None, 2)], topk=0)
        d_logits = _reference_cached(hfm.model, seq, rows.token_id.tolist())
        _check_rows(f"{model_type} generate, prompt of {n} tokens", rows, d_logits,
                    torch.log_softmax(d_logits, dim=-1), rows.token_id)


# ----------------------------------------------------------------------------- refusals


def test_unverified_family_is_refused_in_one_line(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB).save_pretrained(tmp_path)
    with pytest.raises(InputError) as err:
        hf.cfg_check(str(tmp_path), False)
    msg = str(err.value)
    assert "gpt2" in msg and "\n" not in msg


def test_remote_code_is_refused_in_one_line(tmp_path):
    cfg = tiny_config("llama")
    cfg.auto_map = {"AutoModelForCausalLM": "custom.CustomForCausalLM"}
    cfg.save_pretrained(tmp_path)
    hf.cfg_check(str(tmp_path), False)  # without remote code, transformers' own llama runs: accepted
    with pytest.raises(InputError) as err:
        hf.cfg_check(str(tmp_path), True)
    assert "remote code" in str(err.value) and "\n" not in str(err.value)
