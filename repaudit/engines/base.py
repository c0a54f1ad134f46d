"""What every engine takes and yields: sequences in, per-token rows out. Engines never write files."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Sequence:
    prompt_id: str
    prompt: tuple[int, ...]  # token ids
    completion: tuple[int, ...] | None  # reference completion for score mode
    max_new_tokens: int


@dataclass
class TokenRows:
    """Rows of one prompt, positions ascending. logprob and topk_logprobs are float32."""

    prompt_id: str
    prompt_len: int
    pos: np.ndarray
    token_id: np.ndarray
    logprob: np.ndarray
    top1: np.ndarray  # the lowest token id holding the row's largest logprob
    topk_ids: np.ndarray  # [n, k]
    topk_logprobs: np.ndarray  # [n, k]
    digest: np.ndarray | None  # uint64, or None when the engine cannot see the full logits row
    phase: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.phase = np.where(self.pos < self.prompt_len, "prompt", "completion").astype(object)

    @property
    def completion_tokens(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self.token_id[self.pos >= self.prompt_len])


def canonical_topk(ids: np.ndarray, lps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k lists [n, k] in one order whatever engine made them: logprob descending (a NaN
    first), equal logprobs by token id ascending. torch.topk (and vLLM's ranks) leave tied
    entries in any order, and a tie at the top is common enough in bf16 that two engines
    computing the same bits would otherwise name different tokens."""
    if ids.shape[1] < 2:
        return ids, lps
    values = lps.astype(np.float64)
    nan = np.isnan(values)  # above every number, as engines/row_values.py orders them
    order = np.lexsort((ids, -np.where(nan, 0.0, values), ~nan), axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(lps, order, -1)


def topk_with_own(own_ids: np.ndarray, own_lps: np.ndarray, ids: np.ndarray,
                  lps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's top-k lists [n, k] with each row's own token (the sampled or given one, [n]) among
    the candidates, in canonical order, k entries. vLLM's top-k may leave out a tied id that the
    canonical list holds; the own token is one more value known exactly, and in a greedy row it
    is the argmax, the lowest of the ids tied at the top, which three tied logits can keep out
    of a top-2."""
    dup = (ids == own_ids[:, None]).any(axis=1)
    # A repeated own token sorts after everything (-inf, the largest id) and falls off the end.
    extra_ids = np.where(dup, np.iinfo(np.int64).max, own_ids.astype(np.int64))
    extra_lps = np.where(dup, np.float32(-np.inf), own_lps.astype(np.float32))
    both_ids, both_lps = canonical_topk(np.concatenate([ids.astype(np.int64), extra_ids[:, None]], axis=1),
                                        np.concatenate([lps.astype(np.float32), extra_lps[:, None]], axis=1))
    return both_ids[:, :ids.shape[1]], both_lps[:, :ids.shape[1]]


@dataclass
class Timing:
    """Engine time only (forward passes and logits), never repaudit's own bookkeeping."""

    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0
    # Engine time in which prefill and decode interleave (vLLM's scheduler mixes them in its
    # steps): in neither of the two rates above, whose split it cannot give, only in the
    # generated tokens' rate.
    mixed_s: float = 0.0
    # Every generated token, the first ones (which come out of the prefill) too: a generate
    # cell's tokens/s is these over all its engine time, whatever the engine's split.
    generated_tokens: int = 0

    def add(self, other: "Timing") -> None:
        self.prefill_s += other.prefill_s
        self.prefill_tokens += other.prefill_tokens
        self.decode_s += other.decode_s
        self.decode_tokens += other.decode_tokens
        self.mixed_s += other.mixed_s
        self.generated_tokens += other.generated_tokens

    def as_dict(self) -> dict[str, float | int | None]:
        # No tokens, no rate: a decode loop that ran no step (max_new_tokens=1) still spends a few
        # microseconds, and "0 tok/s" would read as a decode that made no progress.
        rate = lambda n, s: n / s if n and s > 0 else None  # noqa: E731
        return {
            "prefill_s": self.prefill_s, "prefill_tokens": self.prefill_tokens,
            "prefill_tokens_per_s": rate(self.prefill_tokens, self.prefill_s),
            "decode_s": self.decode_s, "decode_tokens": self.decode_tokens,
            "decode_tokens_per_s": rate(self.decode_tokens, self.decode_s), "mixed_s": self.mixed_s,
            "generated_tokens": self.generated_tokens,
            "generated_tokens_per_s": rate(self.generated_tokens, self.prefill_s + self.decode_s + self.mixed_s),
        }
