"""The transformers engine's head: which families take their logits from lm_head directly, and
the score path's grouped row values, bit for bit against the head run one chunk at a time.

On a GPU the grouped test also checks the alignment rule (hf_head.ROW_ALIGN): an odd vocabulary
puts rows at every 4-byte offset, where torch's CUDA softmax reduces a row in another order
unless each chunk starts where it would in a tensor of its own.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from repaudit.engines import hf, hf_head  # noqa: E402
from repaudit.engines.base import Sequence  # noqa: E402
from repaudit.engines.row_values import row_values  # noqa: E402
from repaudit.run.kernelmodes import kernel_mode  # noqa: E402

VOCAB = 1001  # odd: rows of fp32 logits start at every 4-byte offset mod 16
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def _config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=256)


def _load(model_type: str, path, device: str = "cpu") -> hf.HFModel:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(_config(model_type), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)
    dtype = "bfloat16" if device == "cuda" else "float32"
    return hf.load(str(path), dtype=dtype, device=device, tp=1, stop_ids=(), pad_id=0)


@pytest.mark.parametrize("model_type, plain", [("llama", True), ("qwen3", True), ("gemma", True),
                                               ("granite", False), ("gemma2", False), ("cohere", False)])
def test_only_llama_form_heads_skip_the_forward(model_type, plain, tmp_path):
    """Granite scales its logits, Gemma 2 soft-caps them, Cohere multiplies by logit_scale: their
    forwards must run. Gemma's forward is Llama's (its scaling is in the base model)."""
    hfm = _load(model_type, tmp_path)
    assert hf_head.head_is_lm_head(hfm.model) is plain


def test_a_hook_or_an_instance_forward_makes_the_forward_run(tmp_path):
    hfm = _load("llama", tmp_path)
    handle = hfm.model.register_forward_hook(lambda module, args, out: out)
    assert not hf_head.head_is_lm_head(hfm.model)
    handle.remove()
    assert hf_head.head_is_lm_head(hfm.model)
    hfm.model.forward = hfm.model.forward  # bound on the instance: whatever it is, it runs
    assert not hf_head.head_is_lm_head(hfm.model)


def _chunkwise(hfm: hf.HFModel, hidden: torch.Tensor, seqs: list[list[int]], topk: int) -> dict[str, np.ndarray]:
    """The head one chunk at a time into tensors of their own: the layout before grouping."""
    parts = []
    for b, seq in enumerate(seqs):
        n = len(seq)
        step = n if n <= hf_head.LOGIT_ROWS_PER_CHUNK + 1 else hf_head.LOGIT_ROWS_PER_CHUNK
        for i in range(0, n - 1, step):
            j = min(i + step, n)
            kept = min(j, n - 1) - i
            logits = hf_head.model_logits(hfm.model, hidden[b, i:j][None])[0].float()
            lp = hfm.log_softmax(logits)
            targets = torch.tensor(seq[i + 1 : i + 1 + kept], device=hidden.device)
            parts.append(hf_head.host_values(row_values(logits[:kept], lp[:kept], targets, topk)))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernels", ["stock", "tbik"])
@pytest.mark.parametrize("model_type", ["llama", "granite"])
def test_grouped_row_values_equal_the_chunkwise_ones(model_type, kernels, device, tmp_path, monkeypatch):
    """Sequences of 2 to 23 tokens, chunks of 8 rows, groups of about 24 rows: chunks start at
    every offset, groups end mid-batch, and a long sequence spans groups."""
    hfm = _load(model_type, tmp_path, device)
    monkeypatch.setattr(hf_head, "LOGIT_ROWS_PER_CHUNK", 8)
    monkeypatch.setattr(hf_head, "GROUP_BYTES", 24 * 4 * VOCAB + 3)
    g = np.random.default_rng(3)
    lens = [2, 3, 23, 5, 9, 17, 4, 11]
    seqs = [g.integers(1, VOCAB, n).tolist() for n in lens]
    hidden = torch.randn(len(lens), max(lens), 64, generator=torch.Generator().manual_seed(5))
    hidden = hidden.to(device=device, dtype=next(hfm.model.parameters()).dtype)
    with kernel_mode(hfm, kernels), torch.inference_mode():
        grouped = hf_head.score_values(hfm.model, hfm.log_softmax, hidden, hf_head.head_plan(seqs, hidden.device), 3)
        want = _chunkwise(hfm, hidden, seqs, topk=3)
    assert grouped["logprob"].shape == (sum(lens) - len(lens),)
    for key, value in want.items():
        np.testing.assert_array_equal(grouped[key].view(np.uint8), value.view(np.uint8), err_msg=key)


@pytest.mark.parametrize("device", DEVICES)
def test_tbik_log_softmax_writes_out_with_its_own_bits(device):
    import tbik

    x = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.full((16, VOCAB), float("nan"), device=device)
    got = tbik.log_softmax(x[4:8], -1, out=out[4:8])
    assert got.data_ptr() == out[4:8].data_ptr()
    assert torch.equal(out[4:8].view(torch.int32), tbik.log_softmax(x[4:8].clone(), -1).view(torch.int32))
    assert torch.isnan(out[:4]).all() and torch.isnan(out[8:]).all()
    with pytest.raises(ValueError, match="out= must be"):
        tbik.log_softmax(x, -1, out=out)


@pytest.mark.parametrize("model_type", ["llama", "granite"])
def test_a_sequence_one_row_longer_than_a_chunk_runs_as_one_gemm(model_type, tmp_path, monkeypatch):
    """A sequence of LOGIT_ROWS_PER_CHUNK + 1 tokens has LOGIT_ROWS_PER_CHUNK rows to record, and
    runs through the head as one GEMM of all its rows, as model(ids) does (docs/engine.md: only
    longer ones go in chunks). It used to run its recorded rows only, a GEMM one row short; on CPU
    a 3-row product's bits are not a 4-row one's, so chunks of 3 rows show it with 4 tokens."""
    hfm = _load(model_type, tmp_path)
    monkeypatch.setattr(hf_head, "LOGIT_ROWS_PER_CHUNK", 3)
    seq = [11, 500, 27, 930]
    assert [c[1:3] for c in hf_head.head_plan([seq], torch.device("cpu")).chunks] == [(0, 4)]
    with torch.inference_mode():
        logits = hfm.model(torch.tensor([seq])).logits.float()[0]
    lp = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(seq[1:])]
    (rows,), _ = hf.score(hfm, [Sequence("s", tuple(seq[:2]), tuple(seq[2:]), 0)], topk=0)
    assert np.array_equal(rows.logprob.view(np.uint32), lp.numpy().view(np.uint32))
