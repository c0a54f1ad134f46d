"""What a diff of two records yields: its dataclasses, their JSON form, and what makes two
records comparable at all."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from ..record.io import RecordMeta

NO_DIVERGENCE = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Thresholds:
    """None everywhere means strict: any flipped bit, digest or token fails."""

    max_ulp: int | None = None
    max_abs: float | None = None
    max_seq_divergence: float = 0.0

    def __post_init__(self) -> None:
        # Plain Python numbers: a numpy scalar (np.float64(0.5), as thresholds computed with numpy
        # are) reprs as "np.float64(0.5)", which broke the exact seq-divergence comparison, the
        # reasons' text and the reproduce command, and np.int64 is not JSON.
        if self.max_ulp is not None:
            if isinstance(self.max_ulp, float) and not math.isfinite(self.max_ulp):
                raise ValueError(f"max_ulp must be a whole number >= 0, got {self.max_ulp!r}")
            ulp = int(self.max_ulp)
            if ulp != self.max_ulp or ulp < 0:
                raise ValueError(f"max_ulp must be a whole number >= 0, got {self.max_ulp!r}")
            object.__setattr__(self, "max_ulp", ulp)
        # The bounds the CLI flags enforce, here too for the Python API: every check is "value >
        # threshold", so a NaN threshold (a tolerance computed from data that held a NaN) failed
        # no pair at all, and a NaN max_seq_divergence raised inside the verdict.
        if self.max_abs is not None:
            max_abs = float(self.max_abs)
            if not max_abs >= 0.0:  # NaN included
                raise ValueError(f"max_abs must be a number >= 0 (inf tolerates any distance), got {self.max_abs!r}")
            object.__setattr__(self, "max_abs", max_abs)
        seq = float(self.max_seq_divergence)
        if not 0.0 <= seq <= 1.0:  # NaN included
            raise ValueError(f"max_seq_divergence must be a fraction in [0, 1], got {self.max_seq_divergence!r}")
        object.__setattr__(self, "max_seq_divergence", seq)

    @property
    def strict(self) -> bool:
        return self.max_ulp is None and self.max_abs is None


@dataclass
class PromptDiff:
    prompt_id: str
    in_a: bool
    in_b: bool
    rows_a: int = 0
    rows_b: int = 0
    matched: int = 0
    comparable: int = 0
    bitwise_equal: int = 0
    max_ulp: int = 0
    first_token_divergence: int | None = None
    first_logprob_divergence: int | None = None

    @property
    def token_match(self) -> bool:
        return self.in_a and self.in_b and self.first_token_divergence is None

    @property
    def bitwise_match(self) -> bool:
        return self.token_match and self.first_logprob_divergence is None

    @property
    def first_divergence(self) -> int | None:
        """Where the prompt first diverges: its tokens fork or its logprob bits differ, whichever is earlier."""
        return min((x for x in (self.first_token_divergence, self.first_logprob_divergence) if x is not None),
                   default=None)


_PROMPT_FIELDS = tuple(f.name for f in fields(PromptDiff))  # every field holds a str, bool, int or None

DEFAULT_CLIP = (0.5, 2.0)


@dataclass
class RLMetrics:
    """Trainer / rollout mismatch over the RL positions: comparable rows (same prompt, pos and token after
    the same context) whose logprobs are finite on both sides. d = lp_b - lp_a; a is the rollout (the
    sampling policy), b the trainer. None where there is no position (or, for the flip numbers, no top-1
    or top-k to use). docs/metrics.md gives each formula and its precision."""

    positions: int = 0
    nonfinite: int = 0  # comparable rows left out: a NaN or ±inf logprob on a side
    clip: tuple[float, float] = DEFAULT_CLIP
    kl_k1: float | None = None
    kl_k2: float | None = None
    kl_k3: float | None = None
    ratio_min: float | None = None
    ratio_p50: float | None = None
    ratio_p99: float | None = None
    ratio_max: float | None = None
    abs_diff_mean: float | None = None
    abs_diff_max: float | None = None
    clip_frac: float | None = None
    seq_log_ratio_max: float | None = None
    flip_positions: int = 0  # RL positions where both top-1 ids are recorded
    flips: int = 0
    flip_rate: float | None = None
    flip_margin_p50: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: [json_float(x) for x in self.clip] if f.name == "clip" else json_float(getattr(self, f.name))
                for f in fields(self)}


@dataclass
class DiffResult:
    a: RecordMeta
    b: RecordMeta
    thresholds: Thresholds
    rows_a: int = 0
    rows_b: int = 0
    matched: int = 0
    comparable: int = 0
    after_divergence: int = 0
    unmatched_a: int = 0
    unmatched_b: int = 0
    bitwise_equal: int = 0
    nan_vs_number: int = 0
    nan_payload_differs: int = 0
    ulp_max: int = 0
    ulp_mean: float = 0.0
    ulp_p50: int = 0
    ulp_p99: int = 0
    abs_max: float = 0.0
    abs_mean: float = 0.0
    prob_max: float = 0.0
    digest_compared: int = 0
    digest_equal: int = 0
    digest_only_a: int = 0  # rows of a shared context with a digest in A and none in B
    digest_only_b: int = 0
    # Rows of each whole record, matched or not, that hold a row digest (None: a stored diff made
    # before they were counted). A record with none is one whose engine never sees the logits row.
    digest_rows_a: int | None = None
    digest_rows_b: int | None = None
    top1_compared: int = 0
    top1_equal: int = 0
    top1_only_a: int = 0
    top1_only_b: int = 0
    topk_compared: int = 0
    topk_ids_equal: int = 0
    topk_logprobs_equal: int = 0
    topk_only_a: int = 0
    topk_only_b: int = 0
    rl: RLMetrics = field(default_factory=RLMetrics)
    prompts: list[PromptDiff] = field(default_factory=list)
    env_differences: list[tuple[str, Any, Any]] = field(default_factory=list)
    cell_differences: list[tuple[str, Any, Any]] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)  # what differed, when --allow-partial let it through
    passed: bool = True
    reasons: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------- derived rates
    @staticmethod
    def _rate(num: int, den: int) -> float | None:
        return num / den if den else None

    @property
    def bitwise_equal_rate(self) -> float | None:
        return self._rate(self.bitwise_equal, self.comparable)

    @property
    def digest_equal_rate(self) -> float | None:
        return self._rate(self.digest_equal, self.digest_compared)

    @property
    def top1_agreement(self) -> float | None:
        return self._rate(self.top1_equal, self.top1_compared)

    @property
    def topk_ids_equal_rate(self) -> float | None:
        return self._rate(self.topk_ids_equal, self.topk_compared)

    @property
    def topk_logprobs_equal_rate(self) -> float | None:
        return self._rate(self.topk_logprobs_equal, self.topk_compared)

    @property
    def coverage(self) -> list[tuple[str, int, int, int]]:
        """(what, rows compared, rows only A holds it, rows only B holds it) of the columns a record may lack."""
        return [("row digests", self.digest_compared, self.digest_only_a, self.digest_only_b),
                ("top-1 ids", self.top1_compared, self.top1_only_a, self.top1_only_b),
                ("top-k lists", self.topk_compared, self.topk_only_a, self.topk_only_b)]

    @property
    def digest_rows(self) -> tuple[int | None, int | None]:
        return self.digest_rows_a, self.digest_rows_b

    @property
    def not_compared(self) -> list[str]:
        """What could not be compared, as phrases (JSON `not_compared`)."""
        out = []
        for what, compared, only_a, only_b in self.coverage:
            if not (compared or only_a or only_b):
                out.append(f"{what}: in neither record")
            out += [f"{what}: {n} positions hold them in {side} only" for side, n in (("A", only_a), ("B", only_b)) if n]
        if self.rl.nonfinite:
            out.append(f"RL metrics: {self.rl.nonfinite} positions with a NaN or infinite logprob left out")
        if self.rl.flips and self.rl.flip_margin_p50 is None:
            out.append("flip margin: record A holds no top-k list of 2 or more with a numeric margin at the flipped positions")
        return out

    @property
    def shared_prompts(self) -> list[PromptDiff]:
        return [p for p in self.prompts if p.in_a and p.in_b]

    @property
    def seq_token_match_rate(self) -> float | None:
        shared = self.shared_prompts
        return self._rate(sum(p.token_match for p in shared), len(shared))

    @property
    def seq_bitwise_match_rate(self) -> float | None:
        shared = self.shared_prompts
        return self._rate(sum(p.bitwise_match for p in shared), len(shared))

    @property
    def identical(self) -> bool:
        """Every prompt is in both records with the same tokens (so no row is left over), and every bit of
        every recorded column agrees: logprob, row digest, top-1 id, top-k ids and logprobs, with no column
        held on one side only (row digests aside when one record holds none: see one_sided_gap). Identical implies the strict verdict passes, and with the same prompts on
        both sides the strict verdict passes only when identical."""
        return (
            self.comparable == self.bitwise_equal
            and self.digest_equal == self.digest_compared
            and self.top1_equal == self.top1_compared
            and self.topk_ids_equal == self.topk_logprobs_equal == self.topk_compared
            and not any(one_sided_gap(*c, self.digest_rows) for c in self.coverage)
            and all(p.token_match for p in self.prompts)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": _meta_summary(self.a),
            "b": _meta_summary(self.b),
            "verdict": {"passed": self.passed, "identical": self.identical, "reasons": self.reasons},
            "thresholds": {k: json_float(v) for k, v in asdict(self.thresholds).items()},
            "rows": {
                "a": self.rows_a, "b": self.rows_b, "matched": self.matched, "comparable": self.comparable,
                "after_divergence": self.after_divergence, "unmatched_a": self.unmatched_a,
                "unmatched_b": self.unmatched_b,
            },
            "logprob": {
                "bitwise_equal": self.bitwise_equal, "bitwise_equal_rate": self.bitwise_equal_rate,
                "nan_vs_number": self.nan_vs_number, "nan_payload_differs": self.nan_payload_differs,
                "ulp_max": self.ulp_max, "ulp_mean": self.ulp_mean, "ulp_p50": self.ulp_p50,
                "ulp_p99": self.ulp_p99, "abs_max": json_float(self.abs_max),
                "abs_mean": json_float(self.abs_mean), "prob_max": json_float(self.prob_max),
            },
            "digest": {"compared": self.digest_compared, "equal": self.digest_equal, "equal_rate": self.digest_equal_rate,
                       "only_a": self.digest_only_a, "only_b": self.digest_only_b,
                       "record_rows_a": self.digest_rows_a, "record_rows_b": self.digest_rows_b},
            "top1": {"compared": self.top1_compared, "equal": self.top1_equal, "agreement": self.top1_agreement,
                     "only_a": self.top1_only_a, "only_b": self.top1_only_b},
            "topk": {"k_a": self.a.topk, "k_b": self.b.topk, "compared": self.topk_compared,
                     "ids_equal": self.topk_ids_equal, "ids_equal_rate": self.topk_ids_equal_rate,
                     "logprobs_equal": self.topk_logprobs_equal, "logprobs_equal_rate": self.topk_logprobs_equal_rate,
                     "only_a": self.topk_only_a, "only_b": self.topk_only_b},
            "not_compared": self.not_compared,
            "rl": self.rl.to_dict(),
            "sequences": {
                "shared": len(self.shared_prompts),
                "token_match_rate": self.seq_token_match_rate,
                "bitwise_match_rate": self.seq_bitwise_match_rate,
                "only_in_a": [p.prompt_id for p in self.prompts if not p.in_b],
                "only_in_b": [p.prompt_id for p in self.prompts if not p.in_a],
            },
            "prompts": [  # what asdict(p) gives, without its deep copy (5,000 prompts: 40 ms)
                {**{f: getattr(p, f) for f in _PROMPT_FIELDS}, "token_match": p.token_match, "bitwise_match": p.bitwise_match}
                for p in self.prompts
            ],
            "environment_differences": [list(d) for d in self.env_differences],
            "cell_differences": [list(d) for d in self.cell_differences],
            "partial": self.refusals,
        }


def json_float(x: Any) -> Any:
    """JSON has no inf or NaN: a non-finite float (|Δ| against a ±inf logprob) becomes "inf" / "-inf" / "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _meta_summary(meta: RecordMeta) -> dict[str, Any]:
    return {
        "path": str(meta.path) if meta.path else None, "cell": meta.cell, "probes": meta.probes,
        "model": meta.model, "tokenizer": meta.tokenizer, "rows": meta.num_rows, "env": meta.env,
    }


# ------------------------------------------------------------------------------------ checks


def _short(h: Any) -> str:
    return str(h)[:12] if h else "?"


def comparability(a: RecordMeta, b: RecordMeta) -> list[str]:
    """What makes two records incomparable, as phrases; empty when they are comparable."""
    issues = []
    if (a.probes.get("name"), a.probes.get("sha256")) != (b.probes.get("name"), b.probes.get("sha256")):
        issues.append(
            f"probe suite differs ({a.probes.get('name')} sha256 {_short(a.probes.get('sha256'))} vs "
            f"{b.probes.get('name')} sha256 {_short(b.probes.get('sha256'))})"
        )
    if a.tokenizer.get("sha256") != b.tokenizer.get("sha256"):
        issues.append(
            f"tokenizer differs ({a.tokenizer.get('name')} sha256 {_short(a.tokenizer.get('sha256'))} vs "
            f"{b.tokenizer.get('name')} sha256 {_short(b.tokenizer.get('sha256'))})"
        )
    only_a, only_b = sorted(set(a.prompts) - set(b.prompts)), sorted(set(b.prompts) - set(a.prompts))
    if only_a or only_b:
        example = (only_a or only_b)[0]
        issues.append(f"prompt sets differ ({len(only_a)} only in A, {len(only_b)} only in B, e.g. {example!r})")
    return issues


def cell_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k != "id" and a.get(k) != b.get(k)]


def one_sided_gap(what: str, compared: int, only_a: int, only_b: int,
                  digest_rows: tuple[int | None, int | None] = (None, None)) -> bool:
    """Whether a column held by one record only counts against the pair. It does, so that a missing
    column is never taken as equal, except row digests missing from a whole record: an engine that
    never sees the full logits row (vLLM) records none, and a trainer-versus-rollout pair is then
    judged on every column both hold (diff lists the digests under not_compared). Whole means
    every row of the record, matched or not (digest_rows: rows of A, of B holding a digest): a
    record with digests on rows the other record lacks is not one whose engine cannot make them.
    Where those counts are unknown (None), the rows compared decide."""
    if not (only_a or only_b):
        return False
    if what != "row digests" or compared or (only_a and only_b):
        return True
    lacking = digest_rows[1] if only_a else digest_rows[0]
    return bool(lacking)
