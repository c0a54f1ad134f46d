"""Row digest: the torch implementation equals the numpy reference bit for bit, sees every
single flipped bit, and does not depend on how many rows are hashed together."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from repaudit.record.digest import numpy_row_digest, row_digest, to_uint64

SPECIAL = np.array([0x7FC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x80000000, 0x00000000,
                    0x00000001, 0x80000001, 0x7F800000, 0xFF800000, 0x7F7FFFFF], dtype=np.uint32)


def random_rows(rows: int, vocab: int, seed: int) -> np.ndarray:
    """float32 rows of random bit patterns (every NaN, inf, subnormal is possible) plus the specials."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 32, (rows, vocab), dtype=np.uint64).astype(np.uint32)
    normal = rng.standard_normal((rows, vocab)).astype(np.float32).view(np.uint32)
    bits = np.where(rng.random((rows, vocab)) < 0.5, bits, normal)
    flat = bits.reshape(-1)
    flat[rng.choice(flat.size, min(flat.size, 3 * len(SPECIAL)), replace=False)] = np.resize(SPECIAL, min(flat.size, 3 * len(SPECIAL)))
    return bits.view(np.float32)


def torch_digest(rows: np.ndarray, **kw) -> np.ndarray:
    return to_uint64(row_digest(torch.from_numpy(np.ascontiguousarray(rows)), **kw))


@pytest.mark.parametrize("rows, vocab, seed", [(1, 1, 0), (3, 7, 1), (70, 33, 2), (5, 4099, 3)])
def test_torch_equals_numpy_reference(rows, vocab, seed):
    x = random_rows(rows, vocab, seed)
    want = numpy_row_digest(x)
    assert want.dtype == np.uint64 and want.shape == (rows,)
    got = torch_digest(x)
    assert got.dtype == np.uint64
    assert np.array_equal(got, want)


def test_reference_matches_the_documented_formula():
    """digest = sum_i mix(bits_i XOR key(i)) mod 2**64, written out with Python integers."""
    M64 = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    x = random_rows(2, 9, 4)
    for row, got in zip(x, numpy_row_digest(x)):
        bits = row.view(np.uint32).tolist()
        keys = [mix((i + 0x5EED0F7B1C + 0x9E3779B97F4A7C15) & M64) for i in range(len(bits))]
        assert int(got) == sum(mix(b ^ k) for b, k in zip(bits, keys)) & M64


def test_batch_shapes_and_chunking_do_not_matter():
    x = random_rows(130, 50, 5)
    alone = np.array([torch_digest(x[i : i + 1])[0] for i in range(len(x))], dtype=np.uint64)
    for kw in ({"rows_per_chunk": 1}, {"rows_per_chunk": 7}, {"rows_per_chunk": 64}, {}):
        assert np.array_equal(torch_digest(x, **kw), alone), kw
    # [..., V] shapes: the leading dimensions are kept
    t = torch.from_numpy(x[:120].reshape(4, 30, 50).copy())
    assert np.array_equal(to_uint64(row_digest(t)).reshape(-1), alone[:120])
    # a non-contiguous view hashes its values, not its storage
    strided = torch.from_numpy(x.copy())[::3]
    assert np.array_equal(to_uint64(row_digest(strided)), alone[::3])


def test_every_single_bit_flip_changes_the_digest():
    vocab = 12
    base = random_rows(1, vocab, 6)[0].view(np.uint32)
    flips = np.repeat(base[None, :], vocab * 32, axis=0)
    for i in range(vocab):
        flips[i * 32 : (i + 1) * 32, i] ^= (np.uint32(1) << np.arange(32, dtype=np.uint32))
    rows = np.concatenate([base[None, :], flips]).view(np.float32)
    want = numpy_row_digest(rows)
    got = torch_digest(rows)
    assert np.array_equal(got, want)
    assert (got[1:] != got[0]).all()  # each of the 384 one-bit changes is seen
    assert len(np.unique(got)) == len(got)


def test_signed_zero_nan_payload_and_position_are_seen():
    row = np.array([0.0, 1.0, 2.0, np.nan], np.float32)
    neg_zero = row.copy()
    neg_zero[0] = -0.0
    payload = row.copy()
    payload.view(np.uint32)[3] = 0x7FC00001
    swapped = row[[1, 0, 2, 3]]
    d = torch_digest(np.stack([row, neg_zero, payload, swapped]))
    assert len(set(d.tolist())) == 4


def test_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        row_digest(torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_column_shards_sum_to_the_whole_row(dtype):
    """Tracing digests a column-sharded activation as the sum of its ranks' partial digests."""
    x = torch.randn(5, 48).to(dtype)
    whole = row_digest(x)
    for shards in (2, 4, 8):
        w = 48 // shards
        parts = [row_digest(x[:, r * w:(r + 1) * w], offset=r * w) for r in range(shards)]
        assert torch.equal(torch.stack(parts).sum(0), whole)  # int64 sum wraps mod 2^64, like the digest
    flipped = x.clone()
    flipped.view(torch.int16 if dtype != torch.float32 else torch.int32)[2, 7] ^= 1
    assert row_digest(flipped)[2] != whole[2] and torch.equal(row_digest(flipped)[[0, 1, 3, 4]], whole[[0, 1, 3, 4]])


def test_torch_digests_survive_a_record_round_trip(make_record):
    """int64 torch digests (top bit set included) go into a record as the same uint64 bits."""
    from repaudit.records import load_frame

    x = random_rows(6, 20, 7)
    d_torch = row_digest(torch.from_numpy(x))
    assert d_torch.dtype == torch.int64 and (d_torch < 0).any()  # values with the top bit set occur
    path = make_record("d.parquet", prompt_id=["p"] * 6, pos=np.arange(6), logprob=torch.zeros(6),
                       row_digest=d_torch, top1_id=torch.arange(6))
    got = load_frame(path)["row_digest"].to_numpy(dtype=np.uint64)
    assert np.array_equal(got, numpy_row_digest(x))
