"""Audit: every number of `repaudit diff` (the DiffResult fields and the whole "rl" object of
`--json`) against a small independent reference that works row by row from the float32 bit
patterns, straight from the definitions in docs/metrics.md.

The record pairs come from fixed seeds and are built to reach the edge cases: NaNs with different
payloads, ±inf, -0.0 against +0.0, subnormals, ±FLT_MAX, forks, B shorter or longer, holes,
prompt-phase rows one record lacks, prompts in one record only, top-k lists of different sizes,
empty or null, row digests on some rows only, top-k ids up to 2**20, several --clip bounds.

Where the doc promises an exact result (counts, nearest-rank picks, "the real-number mean, rounded
once") or a float64 summation order the reference can replay (kl_k2, seq_log_ratio_max), the test
asserts equal float64 bit patterns. kl_k3 is compared within the bound the doc states for it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from decimal import Decimal, localcontext
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import TEST_ENV, TEST_MODEL, TEST_PROBES, TEST_TOKENIZER

from repaudit.diff import diff_records
from repaudit.files import write_json_atomic
from repaudit.records import write_record

SEEDS = range(120)  # about 10 s on two cores
CLIPS = [(0.5, 2.0), (0.0, math.inf), (1.0, 1.5), (1.5, math.inf), (0.25, 1.0)]
SPECIAL = [
    0x00000000, 0x80000000,  # +0.0, -0.0
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # smallest and largest subnormals, both signs
    0x00800000, 0x80800000,  # smallest normals
    0x7F7FFFFF, 0xFF7FFFFF,  # ±FLT_MAX
    0x7F800000, 0xFF800000,  # ±inf
    0x7FC00000, 0xFFC00001, 0x7F800001,  # NaNs: quiet, negative with a payload, signalling
    0xBF800000, 0xBF7FFFFF, 0xC1200000,  # -1.0, the float below it in magnitude, -10.0
    0xC4314000, 0x44318000,  # -709.0 (k3 terms near DBL_MAX against 0), +710.0 (exp overflows)
]


# ------------------------------------------------------------------------------ float32 bits


def value(bits: int) -> float:
    """The float32 value as a Python float (exact)."""
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def is_nan(bits: int) -> bool:
    return bits & 0x7FFFFFFF > 0x7F800000


def position(bits: int) -> int:
    """The ULP line of docs/metrics.md: the low 31 bits, negated when the sign bit is set."""
    magnitude = bits & 0x7FFFFFFF
    return -magnitude if bits >> 31 else magnitude


def bits64(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def zero_sign_key(x: float) -> tuple[float, bool]:
    """Sort key ordering -0.0 before +0.0 (the doc's rule for picks that land on a zero)."""
    return x, math.copysign(1.0, x) > 0


def nearest_rank(values: list, num: int, den: int, key=None):
    """The k-th smallest, k = max(1, ceil(n * num / den)), in integers."""
    ordered = sorted(values, key=key)
    return ordered[max(1, -(-len(ordered) * num // den)) - 1]


def np_exp(x: float) -> float:
    """float64 numpy.exp, as the doc specifies for ratios, clip bounds and probabilities (inf on overflow)."""
    with np.errstate(over="ignore"):
        return float(np.exp(np.float64(x)))


# ------------------------------------------------------------------------------ random records


@dataclass(frozen=True)
class Row:
    token: int
    bits: int  # the logprob's float32 bit pattern
    top1: int  # -1: not recorded
    topk: tuple[tuple[int, ...], tuple[int, ...]] | None  # (ids, logprob bits); None: no list on the row
    digest: int | None
    phase: str = "completion"


def random_logprob(rng: np.random.Generator) -> int:
    if rng.random() < 0.5:
        return int(rng.choice(SPECIAL))
    # Ordinary logprobs spread over many binades, so d often crosses a power of two (rounded in float64).
    return int(np.float32(-rng.exponential(2.0) * 10.0 ** int(rng.integers(-30, 3))).view(np.uint32))


def derived_logprob(rng: np.random.Generator, bits: int) -> int:
    """B's logprob from A's: equal, a few ULP off (wrapping into NaN or across zero), sign flipped, special or unrelated."""
    u = rng.random()
    if u < 0.35:
        return bits
    if u < 0.55:
        return (bits + int(rng.integers(-2, 3))) & 0xFFFFFFFF
    if u < 0.65:
        return bits ^ 0x80000000
    return random_logprob(rng)


def topk_logprob(rng: np.random.Generator) -> int:
    """A special (NaN, infinite and signed-zero margins) or a coarse grid (ties, so zero margins)."""
    if rng.random() < 0.3:
        return int(rng.choice(SPECIAL))
    return int(np.float32(-(int(rng.integers(0, 8)) / 4)).view(np.uint32))


def random_topk(rng: np.random.Generator, k: int):
    if rng.random() < 0.1:
        return None
    ids = tuple(int(x) for x in rng.integers(0, 1 << 20, k))
    lps = tuple(topk_logprob(rng) for _ in range(k))
    if k >= 2 and rng.random() < 0.2:  # a tie at the top between zeros of either sign: a margin of +0.0 or -0.0
        lps = tuple(int(x) for x in rng.choice([0, 0x80000000], 2)) + lps[2:]
    return ids, lps


def derived_topk(rng: np.random.Generator, topk_a, k_b: int):
    """B's list: its own, or A's (sometimes with its first logprob one bit off) cut or padded to B's size.
    The padding is id 0 with logprob +0.0, what a zero-padded array holds: lists of other lengths
    are never equal, however alike their shared part."""
    if topk_a is None or rng.random() < 0.4:
        return random_topk(rng, k_b)
    ids, lps = topk_a
    if lps and rng.random() < 0.3:
        lps = (lps[0] ^ 1,) + lps[1:]
    pad = (0,) * max(0, k_b - len(ids))
    return (ids + pad)[:k_b], (lps + pad)[:k_b]


def random_digest(rng: np.random.Generator) -> int | None:
    return int(rng.integers(0, 1 << 64, dtype=np.uint64)) if rng.random() < 0.8 else None


def add_prompt(rng: np.random.Generator, pid: str, a: dict, b: dict, shape: str) -> None:
    n = int(rng.integers(1, 25))
    n_prompt = int(rng.integers(1, n)) if n > 1 and rng.random() < 0.3 else 0  # leading prompt-phase rows
    drop = str(rng.choice(["none", "a", "b"])) if n_prompt else "none"  # the generate record lacks the prompt rows
    fork = int(rng.integers(0, n)) if shape == "fork" else n
    stop_b = int(rng.integers(1, n)) if shape == "shorter" and n > 1 else n
    hole = int(rng.integers(0, n)) if shape == "hole" else None
    k_a = int(rng.choice([0, 1, 2, 3]))
    k_b = k_a if rng.random() < 0.5 else int(rng.choice([0, 1, 2, 3, 5]))
    for pos in range(n):
        phase = "prompt" if pos < n_prompt else "completion"
        row_a = Row(pos + 7, random_logprob(rng), int(rng.integers(-1, 4)), random_topk(rng, k_a), random_digest(rng), phase)
        if not (drop == "a" and phase == "prompt"):
            a[pid, pos] = row_a
        if pos >= stop_b or pos == hole or (drop == "b" and phase == "prompt"):
            continue
        top1 = row_a.top1 if rng.random() < 0.7 else int(rng.integers(-1, 4))
        digest = row_a.digest if rng.random() < 0.6 else random_digest(rng)
        b[pid, pos] = Row(row_a.token + (pos >= fork), derived_logprob(rng, row_a.bits), top1,
                          derived_topk(rng, row_a.topk, k_b), digest, phase)
    if shape == "longer":
        for pos in range(n, n + int(rng.integers(1, 4))):
            b[pid, pos] = Row(1, random_logprob(rng), 1, random_topk(rng, k_b), random_digest(rng))


def random_pair(seed: int) -> tuple[dict, dict]:
    """Records A and B as {(prompt_id, pos): Row}."""
    rng = np.random.default_rng(seed)
    a, b = {}, {}
    shapes = ["same", "same", "fork", "shorter", "longer", "hole"]
    for i in range(int(rng.integers(1, 7))):
        # p0 keeps its shape "same" so that neither record is empty (an empty record is refused).
        add_prompt(rng, f"p{i}", a, b, "same" if i == 0 else str(rng.choice(shapes)))
    if rng.random() < 0.3:  # a prompt one record holds and the other does not (--allow-partial)
        add_prompt(rng, "solo", *((a, {}) if rng.random() < 0.5 else ({}, b)), "same")
    if seed % 4 == 3:  # a record with no row digest at all (a vLLM record)
        b = {key: replace(row, digest=None) for key, row in b.items()}
    return a, b


def write(path: Path, rows: dict, null_lists: bool, row_group: int) -> Path:
    """The record, with ragged top-k lists (a missing one null or empty) and digests on some rows only,
    which write_record's rectangular arrays cannot say: its file, with those columns replaced."""
    keys = sorted(rows)  # the canonical order write_record writes in
    write_record(path, prompt_id=[p for p, _ in keys], pos=np.array([q for _, q in keys]),
                 token_id=np.array([rows[x].token for x in keys]),
                 logprob=np.array([rows[x].bits for x in keys], np.uint32).view(np.float32),
                 top1_id=np.array([rows[x].top1 for x in keys]), phase=[rows[x].phase for x in keys],
                 cell={"id": path.stem}, env=dict(TEST_ENV), probes=dict(TEST_PROBES), model=dict(TEST_MODEL),
                 tokenizer=dict(TEST_TOKENIZER))
    table = pq.read_table(path)
    lists = [rows[x].topk for x in keys]
    lengths = [0 if t is None else len(t[0]) for t in lists]
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    mask = pa.array([t is None for t in lists]) if null_lists else None
    for name, values in (("topk_ids", np.array([i for t in lists if t for i in t[0]], np.int32)),
                         ("topk_logprobs", np.array([v for t in lists if t for v in t[1]], np.uint32).view(np.float32))):
        column = pa.ListArray.from_arrays(offsets, pa.array(values), mask=mask)
        i = table.schema.get_field_index(name)
        table = table.set_column(i, pa.field(name, column.type, nullable=null_lists), column)
    i = table.schema.get_field_index("row_digest")
    table = table.set_column(i, table.schema.field(i), pa.array([rows[x].digest for x in keys], pa.uint64()))
    metadata = {**table.schema.metadata, b"repaudit.topk": str(max(lengths)).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), path, row_group_size=row_group)
    return path


# ------------------------------------------------------------------------------ the reference


def divergence(pid: str, a: dict, b: dict) -> int | None:
    """The token divergence: the first position where both rows exist with different tokens, or one
    side lacks a row, except a prompt row before the other record's first row of the prompt."""
    pos_a, pos_b = {q for p, q in a if p == pid}, {q for p, q in b if p == pid}
    breaks = [q for q in pos_a & pos_b if a[pid, q].token != b[pid, q].token]
    breaks += [q for q in pos_a - pos_b if not (a[pid, q].phase == "prompt" and q < min(pos_b))]
    breaks += [q for q in pos_b - pos_a if not (b[pid, q].phase == "prompt" and q < min(pos_a))]
    return min(breaks, default=None)


def holds_topk(row: Row) -> bool:
    return row.topk is not None and len(row.topk[0]) > 0


def count_column(f: dict, name: str, has_a: bool, has_b: bool) -> bool:
    """Counts a row of a column a record may lack; True where both hold it, so that it is compared."""
    if has_a and has_b:
        f[f"{name}_compared"] += 1
        return True
    f[f"{name}_only_a"] += has_a
    f[f"{name}_only_b"] += has_b
    return False


def reference(a: dict, b: dict, clip: tuple[float, float]) -> dict:
    """Every number the diff computes, the slow way. Returns the DiffResult fields, the per-prompt
    fields and the RL ingredients (rl_rows: (prompt, d, exact d, bits differ) in row order)."""
    f = dict.fromkeys(["matched", "comparable", "after_divergence", "unmatched_a", "unmatched_b", "bitwise_equal",
                       "nan_vs_number", "nan_payload_differs", "digest_compared", "digest_equal", "digest_only_a",
                       "digest_only_b", "top1_compared", "top1_equal", "top1_only_a", "top1_only_b", "topk_compared",
                       "topk_ids_equal", "topk_logprobs_equal", "topk_only_a", "topk_only_b"], 0)
    ulps, abs_diffs, probs, prompts = [], [], [], {}
    rl_rows, margins = [], []
    rl = dict(positions=0, nonfinite=0, flip_positions=0, flips=0)
    for pid in sorted({p for p, _ in a} | {p for p, _ in b}):
        pos_a, pos_b = sorted(q for p, q in a if p == pid), sorted(q for p, q in b if p == pid)
        shared = sorted(set(pos_a) & set(pos_b))
        prompt = dict(in_a=bool(pos_a), in_b=bool(pos_b), rows_a=len(pos_a), rows_b=len(pos_b), matched=0,
                      comparable=0, bitwise_equal=0, max_ulp=0, first_token_divergence=None,
                      first_logprob_divergence=None)
        prompts[pid] = prompt
        if not (pos_a and pos_b):  # left out by --allow-partial: neither compared nor unmatched
            continue
        div = prompt["first_token_divergence"] = divergence(pid, a, b)
        f["unmatched_a"] += len(pos_a) - len(shared)
        f["unmatched_b"] += len(pos_b) - len(shared)
        for q in shared:
            ra, rb = a[pid, q], b[pid, q]
            prompt["matched"] += 1
            if div is not None and q > div:
                f["after_divergence"] += 1
                continue
            if count_column(f, "digest", ra.digest is not None, rb.digest is not None):
                f["digest_equal"] += ra.digest == rb.digest
            if count_column(f, "top1", ra.top1 >= 0, rb.top1 >= 0):
                f["top1_equal"] += ra.top1 == rb.top1
            if count_column(f, "topk", holds_topk(ra), holds_topk(rb)):
                f["topk_ids_equal"] += ra.topk[0] == rb.topk[0]  # tuples: other lengths are never equal
                f["topk_logprobs_equal"] += ra.topk[1] == rb.topk[1]  # bit patterns: -0.0 is not +0.0, one NaN's bits equal
            if q == div:  # same context, different tokens: the distribution compares, the logprob does not
                continue
            prompt["comparable"] += 1
            xa, xb = value(ra.bits), value(rb.bits)
            if ra.bits == rb.bits:
                prompt["bitwise_equal"] += 1
                ulps.append(0)
                abs_diffs.append(Fraction(0))
            else:
                if prompt["first_logprob_divergence"] is None:
                    prompt["first_logprob_divergence"] = q
                if is_nan(ra.bits) and is_nan(rb.bits):
                    f["nan_payload_differs"] += 1
                elif is_nan(ra.bits) or is_nan(rb.bits):
                    f["nan_vs_number"] += 1
                else:
                    ulp = abs(position(ra.bits) - position(rb.bits))
                    ulps.append(ulp)
                    prompt["max_ulp"] = max(prompt["max_ulp"], ulp)
                    abs_diffs.append(math.inf if math.isinf(xa) or math.isinf(xb) else abs(Fraction(xa) - Fraction(xb)))
                    prob = abs(np_exp(xa) - np_exp(xb))
                    probs.append(math.inf if math.isnan(prob) else prob)  # inf - inf: both exps overflow
            if not (math.isfinite(xa) and math.isfinite(xb)):
                rl["nonfinite"] += 1
                continue
            rl["positions"] += 1
            rl_rows.append((pid, xb - xa, Fraction(xb) - Fraction(xa), ra.bits != rb.bits))  # xb - xa: rounded once
            if ra.top1 >= 0 and rb.top1 >= 0:
                rl["flip_positions"] += 1
                if ra.top1 != rb.top1:
                    rl["flips"] += 1
                    if ra.topk is not None and len(ra.topk[1]) >= 2:
                        margin = value(ra.topk[1][0]) - value(ra.topk[1][1])
                        if not math.isnan(margin):
                            margins.append(margin)
        f["matched"] += prompt["matched"]
        f["comparable"] += prompt["comparable"]
        f["bitwise_equal"] += prompt["bitwise_equal"]
    n = len(ulps)
    f.update(
        rows_a=len(a), rows_b=len(b),
        digest_rows_a=sum(r.digest is not None for r in a.values()),
        digest_rows_b=sum(r.digest is not None for r in b.values()),
        ulp_max=max(ulps, default=0),
        ulp_mean=float(Fraction(sum(ulps), n)) if n else 0.0,  # exact sum, rounded once
        ulp_p50=nearest_rank(ulps, 1, 2) if n else 0,
        ulp_p99=nearest_rank(ulps, 99, 100) if n else 0,
        abs_max=float(max(abs_diffs)) if n else 0.0,
        abs_mean=(math.inf if math.inf in abs_diffs else float(sum(abs_diffs) / n)) if n else 0.0,
        prob_max=max(probs, default=0.0),
    )
    return dict(fields=f, prompts=prompts, rl=rl, rl_rows=rl_rows, margins=margins, clip=clip)


def rl_reference(ref: dict) -> dict:
    """The JSON "rl" object as docs/metrics.md defines it, kl_k3 aside (see k3_exact)."""
    rows, n, clip = ref["rl_rows"], ref["rl"]["positions"], ref["clip"]
    out = dict(ref["rl"], clip=list(clip))
    if not n:
        return out
    ds = [d for _, d, _, _ in rows]
    differing = [d for _, d, _, differ in rows if differ]  # the d the diff keeps: rows whose bits differ
    sequences = {}
    for pid, d, _, differ in rows:
        if differ:
            sequences.setdefault(pid, []).append(d)
    picks = [nearest_rank(ds, num, den, key=zero_sign_key) for num, den in ((1, 2), (99, 100))]
    flips, flip_positions, margins = ref["rl"]["flips"], ref["rl"]["flip_positions"], ref["margins"]
    out.update(
        kl_k1=float(-sum(exact for _, _, exact, _ in rows) / n),
        # numpy's pairwise sum over the kept d in row order: the order the doc states, replayed.
        kl_k2=float(np.sum(np.square(np.array(differing, np.float64)))) / (2 * n),
        ratio_min=np_exp(min(ds, key=zero_sign_key)), ratio_p50=np_exp(picks[0]), ratio_p99=np_exp(picks[1]),
        ratio_max=np_exp(max(ds, key=zero_sign_key)),
        # "mean exact (rounded once)", against "max of the rounded |d|": the mean is of the unrounded
        # |lp_b - lp_a| (some seeds tell this from the mean of the rounded |d|: see the edge cases).
        abs_diff_mean=float(sum(abs(exact) for _, _, exact, _ in rows) / n),
        abs_diff_max=max(abs(d) for d in ds),
        clip_frac=sum(np_exp(d) < clip[0] or np_exp(d) > clip[1] for d in ds) / n,
        # numpy.add.reduceat per sequence: the first d plus numpy's pairwise sum of the rest.
        seq_log_ratio_max=max((abs(s[0] + float(np.sum(np.array(s[1:], np.float64)))) for s in sequences.values()),
                              default=0.0),
        flip_rate=flips / flip_positions if flip_positions else None,
        flip_margin_p50=nearest_rank(margins, 1, 2, key=zero_sign_key) if margins else None,
    )
    return out


def k3_exact(ref: dict) -> float:
    """mean(exp(d) - 1 - d) over the float64 d, from 130-digit decimals (d down to 2**-149 leaves a term
    near 1e-90 after the cancellation), rounded once; inf where a term passes DBL_MAX."""
    ds = [d for _, d, _, _ in ref["rl_rows"]]
    if any(d > 710 for d in ds):  # a term past DBL_MAX (as from d = 709.78 on), whose exp would overflow the decimals
        return math.inf
    with localcontext() as ctx:
        ctx.prec = 130
        terms = [Decimal(d).exp() - 1 - Decimal(d) for d in ds]
        if any(t > Decimal(np.finfo(np.float64).max) for t in terms):
            return math.inf
        return float(sum(terms, Decimal(0)) / len(ds))


def k3_relative_bound(n_terms: int) -> float:
    """The error docs/metrics.md allows kl_k3: each term at most ~10 ulps off (10 * 2**-52 relative: the
    series' cut is below 2**-56, then "a few ulps"; expm1(d) - d "at most ~10 ulps"), then numpy's
    pairwise float64 sum of the non-negative terms (each term goes through at most h additions, so
    h * 2**-53 relative: h <= 25 within a block of 128, one more per halving above that), then the
    division by N (2**-53)."""
    h = 25 + max(0, math.ceil(math.log2(max(n_terms, 1) / 128)))
    return (20 + h + 1) * 2.0**-53 * (1 + 1e-9)


def as_json(x):
    """What the doc says JSON holds: a non-finite float as the string "inf", "-inf" or "nan"."""
    if isinstance(x, list):
        return [as_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else "inf" if x > 0 else "-inf"
    return x


# ------------------------------------------------------------------------------ comparing


def assert_same(got, want, what: str) -> None:
    """Floats by their float64 bit pattern (so -0.0 is not +0.0); ints, strings, lists and None exactly."""
    if isinstance(want, float):
        assert isinstance(got, float) and bits64(got) == bits64(want), (what, got, want)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (what, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
    else:
        assert type(got) is type(want) and got == want, (what, got, want)


def assert_result_matches(r, ref: dict) -> None:
    for name, want in ref["fields"].items():
        assert_same(getattr(r, name), want, name)
    f = ref["fields"]
    for rate, num, den in (("bitwise_equal_rate", "bitwise_equal", "comparable"),
                           ("digest_equal_rate", "digest_equal", "digest_compared"),
                           ("top1_agreement", "top1_equal", "top1_compared"),
                           ("topk_ids_equal_rate", "topk_ids_equal", "topk_compared"),
                           ("topk_logprobs_equal_rate", "topk_logprobs_equal", "topk_compared")):
        assert_same(getattr(r, rate), f[num] / f[den] if f[den] else None, rate)
    got = {p.prompt_id: p for p in r.prompts}
    assert sorted(got) == sorted(ref["prompts"])
    for pid, want in ref["prompts"].items():
        for name, w in want.items():
            assert_same(getattr(got[pid], name), w, f"prompt {pid}: {name}")
    shared = [p for p in ref["prompts"].values() if p["in_a"] and p["in_b"]]
    token_match = [p for p in shared if p["first_token_divergence"] is None]
    bitwise_match = [p for p in token_match if p["first_logprob_divergence"] is None]
    assert_same(r.seq_token_match_rate, len(token_match) / len(shared) if shared else None, "seq_token_match_rate")
    assert_same(r.seq_bitwise_match_rate, len(bitwise_match) / len(shared) if shared else None, "seq_bitwise_match_rate")


def assert_rl_json_matches(rl: dict, ref: dict) -> None:
    want = rl_reference(ref)
    assert set(rl) == set(want) | {"kl_k3"}, sorted(set(rl) ^ set(want))
    for name, w in want.items():
        assert_same(rl[name], as_json(w), f"rl.{name}")
    if not ref["rl"]["positions"]:
        assert rl["kl_k3"] is None
        return
    exact = k3_exact(ref)
    if math.isinf(exact):
        assert rl["kl_k3"] == "inf"
    else:  # within the doc's stated error, not bit for bit: the terms' evaluation is only bounded
        bound = k3_relative_bound(sum(differ for *_, differ in ref["rl_rows"])) * exact
        assert isinstance(rl["kl_k3"], float) and abs(rl["kl_k3"] - exact) <= bound, (rl["kl_k3"], exact, bound)


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("seed", SEEDS)
def test_diff_matches_the_reference(tmp_path, seed):
    a, b = random_pair(seed)
    rng = np.random.default_rng(seed + 1000)  # how the files and batches are cut: no result may depend on it
    null_lists = seed % 2 == 0
    path_a = write(tmp_path / "a.parquet", a, null_lists, int(rng.choice([2, 5, 1 << 20])))
    path_b = write(tmp_path / "b.parquet", b, null_lists, int(rng.choice([3, 4, 1 << 20])))
    clip = CLIPS[seed % len(CLIPS)]
    r = diff_records(path_a, path_b, allow_partial=True, clip=clip, batch_rows=int(rng.choice([1, 3, 7, 1 << 20])))
    ref = reference(a, b, clip)
    assert_result_matches(r, ref)
    # The JSON as `repaudit diff --json` writes it (commands.diff), read back.
    write_json_atomic(tmp_path / "diff.json", r.to_dict())
    assert_rl_json_matches(json.loads((tmp_path / "diff.json").read_text())["rl"], ref)


def test_the_seeds_reach_every_edge_case():
    """The comparison above proves little about a case no seed reaches: each must occur somewhere."""
    seen = dict.fromkeys(["nan payloads differ", "nan against a number", "-0.0 against +0.0", "inf against a number",
                          "subnormal", "fork", "hole or length", "exempt prompt row", "prompt in one record",
                          "digest on one side", "record without digests", "top-k lists differ in size",
                          "null top-k", "flip margin", "k3 infinite", "k2 sum over 8 terms", "median margin -0.0",
                          "top-k of other lengths alike", "mean of |d| moves when d is rounded"], 0)
    for seed in SEEDS:
        a, b = random_pair(seed)
        ref = reference(a, b, CLIPS[seed % len(CLIPS)])
        f = ref["fields"]
        pairs = [(a[k], b[k]) for k in a.keys() & b.keys()]
        seen["nan payloads differ"] += f["nan_payload_differs"]
        seen["nan against a number"] += f["nan_vs_number"]
        seen["-0.0 against +0.0"] += sum({x.bits, y.bits} == {0, 0x80000000} for x, y in pairs)
        seen["inf against a number"] += sum((x.bits & 0x7FFFFFFF == 0x7F800000) != (y.bits & 0x7FFFFFFF == 0x7F800000)
                                            for x, y in pairs)
        seen["subnormal"] += sum(0 < x.bits & 0x7FFFFFFF < 0x800000 for x, _ in pairs)
        seen["fork"] += sum(x.token != y.token for x, y in pairs)
        seen["hole or length"] += f["unmatched_a"] + f["unmatched_b"] > 0
        seen["exempt prompt row"] += sum(p["first_token_divergence"] is None and p["rows_a"] != p["rows_b"]
                                         for p in ref["prompts"].values() if p["in_a"] and p["in_b"])
        seen["prompt in one record"] += any(not (p["in_a"] and p["in_b"]) for p in ref["prompts"].values())
        seen["digest on one side"] += f["digest_only_a"] + f["digest_only_b"] > 0
        seen["record without digests"] += f["digest_rows_b"] == 0
        seen["top-k lists differ in size"] += sum(holds_topk(x) and holds_topk(y) and len(x.topk[0]) != len(y.topk[0])
                                                  for x, y in pairs)
        seen["null top-k"] += sum(x.topk is None for x in a.values())
        seen["top-k of other lengths alike"] += sum(holds_topk(x) and holds_topk(y) and x.topk[0][:len(y.topk[0])]
                                                    == y.topk[0][:len(x.topk[0])] and len(x.topk[0]) != len(y.topk[0])
                                                    for x, y in pairs)
        rows = ref["rl_rows"]
        seen["mean of |d| moves when d is rounded"] += bool(rows) and (
            float(sum(abs(Fraction(d)) for _, d, _, _ in rows) / len(rows))
            != float(sum(abs(exact) for _, _, exact, _ in rows) / len(rows)))
        seen["flip margin"] += len(ref["margins"]) > 0
        seen["k3 infinite"] += math.isinf(k3_exact(ref)) if ref["rl"]["positions"] else 0
        seen["k2 sum over 8 terms"] += sum(differ for *_, differ in ref["rl_rows"]) > 8
        seen["median margin -0.0"] += bool(ref["margins"]) and bits64(
            nearest_rank(ref["margins"], 1, 2, key=zero_sign_key)) == bits64(-0.0)
    assert all(seen.values()), [name for name, count in seen.items() if not count]
