"""The audit matrix: expand it into cells and launch groups, and refuse a bad one up front.

A cell is one point of the matrix; a launch group is the cells that share one distributed
job (same engine, model, TP size and NCCL environment). Inside a group, generate cells run
before score cells (score mode may need the greedy references) and batch sizes ascend, so
an out-of-memory failure at the largest batch size comes last.

A vLLM cell also has a scenario (scenarios.py): `cold`, or a serving feature such as prefix
caching, compared with its cold twin. A combination that cannot give a meaningful cell
(scenarios.REFUSED) is not a cell: the plan keeps it in `refused` with its reason, and the
manifest and the summary show it as refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..engines.vllm_engine import chunk_tokens
from ..errors import InputError
from . import scenarios
from .scenarios import COLD

ENGINES = ("hf", "vllm")
KERNELS = ("stock", "bi", "tbik")
MODES = ("generate", "score")
DTYPES = ("float32", "bfloat16", "float16")
REFERENCE_DIMENSIONS = ("engine", "tp", "batch_size", "nccl", "kernels", "mode")
TBIK_MAX_TP = 8  # tbik.NUM_CHUNKS: the tree has 8 leaves


@dataclass(frozen=True, order=True)
class Cell:
    engine: str
    tp: int
    batch_size: int
    nccl: str
    kernels: str
    mode: str
    scenario: str = COLD

    @property
    def id(self) -> str:
        return (f"{self.engine}-tp{self.tp}-bs{self.batch_size}-{self.nccl}-{self.kernels}"
                f"{scenarios.id_suffix(self.scenario)}-{self.mode}")

    @property
    def group_key(self) -> tuple:
        # vLLM builds its TP group, and reads its kernel switches and engine arguments, once per
        # process: a vLLM job holds one kernel mode and one scenario; its batch sizes and modes run
        # inside it, like a transformers job's.
        return (self.engine, self.tp, self.nccl) + ((self.kernels, self.scenario) if self.engine == "vllm" else ())


@dataclass(frozen=True)
class Matrix:
    """What the user asked for, already parsed into values."""

    model: str
    engines: tuple[str, ...] = ("hf",)
    tps: tuple[int, ...] = (1, 2)
    batch_sizes: tuple[int, ...] = (1, 4)
    nccl: dict[str, dict[str, str]] = field(default_factory=lambda: {"default": {}})
    kernels: tuple[str, ...] = ("stock",)
    modes: tuple[str, ...] = ("generate", "score")
    dtype: str = "auto"  # fp32 on CPU, bf16 on GPU
    device: str = "cpu"  # or cuda, or auto: cuda where a GPU is visible
    probes: str = "smoke"
    max_new_tokens: int | None = None
    topk: int = 5
    baseline: str | None = None
    reference_per: tuple[str, ...] = ("kernels", "mode")
    trace: bool = False
    vllm_args: dict[str, Any] = field(default_factory=dict)  # engine arguments for vLLM cells
    scenarios: tuple[str, ...] = (COLD,)  # vLLM cells only; transformers cells are cold

    # The manifest's "matrix" object: its keys are the command line's (tp, batch_size, mode), and
    # the model and baseline live at the manifest's top level. These two are its only writer and reader.
    def to_manifest(self) -> dict[str, Any]:
        return {"engines": list(self.engines), "tp": list(self.tps), "batch_size": list(self.batch_sizes), "nccl": self.nccl,
                "kernels": list(self.kernels), "mode": list(self.modes), "dtype": self.dtype, "device": self.device,
                "probes": self.probes, "max_new_tokens": self.max_new_tokens, "topk": self.topk,
                "reference_per": list(self.reference_per), "trace": self.trace, "vllm_args": self.vllm_args,
                "scenario": list(self.scenarios)}

    @classmethod
    def from_manifest(cls, m: dict[str, Any], model: str, baseline: str | None) -> "Matrix":
        return cls(model=model, engines=tuple(m["engines"]), tps=tuple(m["tp"]), batch_sizes=tuple(m["batch_size"]),
                   nccl=dict(m["nccl"]), kernels=tuple(m["kernels"]), modes=tuple(m["mode"]), dtype=m["dtype"],
                   device=m["device"], probes=m["probes"], max_new_tokens=m["max_new_tokens"], topk=m["topk"],
                   baseline=baseline, reference_per=tuple(m["reference_per"]), trace=bool(m.get("trace", False)),
                   vllm_args=dict(m.get("vllm_args") or {}), scenarios=tuple(m.get("scenario") or (COLD,)))


@dataclass(frozen=True)
class LaunchGroup:
    engine: str
    tp: int
    nccl: str
    nccl_env: dict[str, str]
    cells: tuple[Cell, ...]

    @property
    def id(self) -> str:
        base = f"{self.engine}-tp{self.tp}-{self.nccl}"
        if self.engine != "vllm":
            return base
        first = self.cells[0]
        return f"{base}-{first.kernels}{scenarios.id_suffix(first.scenario)}"


@dataclass(frozen=True)
class Plan:
    matrix: Matrix
    cells: tuple[Cell, ...]
    groups: tuple[LaunchGroup, ...]
    baseline: Cell
    notes: tuple[str, ...] = ()
    refused: tuple[tuple[Cell, str], ...] = ()  # combinations not run, each with why (scenarios.REFUSED)

    def cell(self, cell_id: str) -> Cell:
        for c in self.cells:
            if c.id == cell_id:
                return c
        raise KeyError(cell_id)

    @property
    def reference_source(self) -> Cell:
        """The greedy generation that score cells use as their reference completion."""
        return replace(self.baseline, mode="generate")

    def reference_for(self, cell: Cell) -> Cell:
        """The cell this one is compared with: for a scenario cell, its cold twin (every other
        setting its own); for a cold cell, the baseline, with the dimensions named in
        `reference_per` taken from the cell itself (by default its kernels and mode)."""
        if cell.scenario != COLD:
            return replace(cell, scenario=COLD)
        ref = replace(self.baseline, **{d: getattr(cell, d) for d in self.matrix.reference_per})
        if ref not in self.cells:
            # TP=1 (and the CPU) runs only the first NCCL preset (no NCCL collective): a reference
            # at TP=1 is that one cell, whichever preset the cell or the baseline names (a TP=2
            # `tree` cell with --reference-per nccl; a TP=1 cell, with --reference-per tp, of a
            # TP=2 `tree` baseline).
            ref = replace(ref, nccl=next(iter(self.matrix.nccl)))
        return ref


def _parse_baseline(text: str, cells: tuple[Cell, ...]) -> Cell:
    by_id = {c.id: c for c in cells}
    # A baseline may omit the mode: "hf-tp1-bs1-default-stock".
    found = by_id.get(text) or next((c for c in cells if c.id.rsplit("-", 1)[0] == text), None)
    if found is not None and found.scenario != COLD:
        raise InputError(f"baseline {text!r} is a {found.scenario} cell: the baseline is a cold cell "
                         "(a scenario cell's reference is its cold twin)")
    if found is not None:
        return found
    examples = ", ".join(sorted({c.id for c in cells})[:4])
    raise InputError(f"baseline {text!r} is not a cell of the matrix (cells look like: {examples}, ...)")


def expand(m: Matrix) -> Plan:
    """Matrix -> cells and launch groups. Validates everything that needs no model."""
    m = replace(m, scenarios=tuple(scenarios.parse(s) for s in m.scenarios))
    for name, values in (("--engine", m.engines), ("--tp", m.tps), ("--batch-size", m.batch_sizes),
                         ("--nccl", tuple(m.nccl)), ("--kernels", m.kernels), ("--mode", m.modes),
                         ("--scenario", m.scenarios)):
        if not values:
            raise InputError(f"{name} is empty: the matrix has no cells")
        if len(set(values)) != len(values):
            raise InputError(f"{name} lists a value twice: {', '.join(map(str, values))}")
    _check_in("--engine", m.engines, ENGINES)
    _check_in("--kernels", m.kernels, KERNELS)
    _check_in("--mode", m.modes, MODES)
    if m.dtype not in DTYPES + ("auto",):
        raise InputError(f"--dtype {m.dtype!r}: expected one of auto, {', '.join(DTYPES)}")
    if m.device not in ("auto", "cpu", "cuda"):
        raise InputError(f"--device {m.device!r}: expected auto, cpu or cuda")
    m = resolve_auto(m)
    for tp in m.tps:
        if tp < 1:
            raise InputError(f"--tp {tp}: TP sizes are positive integers")
        if "tbik" in m.kernels and (tp & (tp - 1) or tp > TBIK_MAX_TP):
            raise InputError(f"--kernels tbik needs TP sizes that are powers of two up to {TBIK_MAX_TP}, got {tp}")
    for bs in m.batch_sizes:
        if bs < 1:
            raise InputError(f"--batch-size {bs}: batch sizes are positive integers")
    if m.max_new_tokens is not None and m.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be at least 1")
    if m.topk < 0:
        raise InputError("--topk must be 0 (off) or more")
    if m.trace and "vllm" in m.engines:
        raise InputError("--trace hooks transformers modules and vLLM's model has none: trace with --engine hf")
    if m.vllm_args and "vllm" not in m.engines:
        raise InputError("--vllm-arg is for --engine vllm")
    bad_per = set(m.reference_per) - set(REFERENCE_DIMENSIONS)
    if bad_per:
        raise InputError(f"--reference-per {sorted(bad_per)}: expected names among {', '.join(REFERENCE_DIMENSIONS)}")

    notes: list[str] = []
    m = _check_scenarios(m, notes)
    cells, refused = [], []
    for engine in m.engines:
        for tp in sorted(m.tps):
            # NCCL variables change nothing where there is no NCCL communication.
            presets = list(m.nccl)
            if (tp == 1 or m.device == "cpu") and len(presets) > 1:
                why = "TP=1 runs no collective" if tp == 1 else "the CPU backend is gloo"
                notes.append(f"{engine} tp{tp}: NCCL presets {', '.join(presets[1:])} skipped ({why}); running {presets[0]!r}")
                presets = presets[:1]
            for nccl in presets:
                for kernels in m.kernels:
                    for scenario in m.scenarios if engine == "vllm" else (COLD,):
                        for mode in sorted(m.modes, key=MODES.index):
                            reason = scenarios.refusal(scenario, kernels, mode)
                            for bs in sorted(m.batch_sizes):
                                cell = Cell(engine, tp, bs, nccl, kernels, mode, scenario)
                                if reason is None:
                                    cells.append(cell)
                                else:
                                    refused.append((cell, reason))
    for reason in dict.fromkeys(r for _, r in refused):
        which = sorted({f"{c.scenario} with {c.kernels} {c.mode}" for c, r in refused if r == reason})
        notes.append(f"{sum(r == reason for _, r in refused)} cell(s) refused, not run ({'; '.join(which)}): {reason}")
    cells_t = tuple(cells)
    baseline = _parse_baseline(m.baseline, cells_t) if m.baseline else cells_t[0]

    groups: dict[tuple, list[Cell]] = {}
    for c in cells_t:
        groups.setdefault(c.group_key, []).append(c)
    ordered = sorted(groups.items(), key=lambda kv: kv[0] != baseline.group_key)  # baseline's group first
    launch = tuple(
        LaunchGroup(engine=k[0], tp=k[1], nccl=k[2], nccl_env=m.nccl[k[2]],
                    cells=tuple(sorted(v, key=lambda c: (MODES.index(c.mode), c.batch_size, m.kernels.index(c.kernels)))))
        for k, v in ordered
    )
    return Plan(matrix=m, cells=cells_t, groups=launch, baseline=baseline, notes=tuple(notes), refused=tuple(refused))


def _check_scenarios(m: Matrix, notes: list[str]) -> Matrix:
    """Scenarios are vLLM's; `cold`, every scenario's reference, is added (first) when not listed."""
    others = [s for s in m.scenarios if s != COLD]
    if others and "vllm" not in m.engines:
        raise InputError(f"--scenario {','.join(others)}: scenarios other than cold are for --engine vllm")
    if others and COLD not in m.scenarios:
        notes.append(f"scenario cold added: every {', '.join(others)} cell is compared with its cold twin")
    if others and "hf" in m.engines:
        notes.append(f"hf: scenario {', '.join(others)} applies to vLLM cells only; transformers cells run cold")
    for s in others:
        n = chunk_tokens(s)
        if n is not None and n < max(m.batch_sizes):
            raise InputError(f"--scenario {s}: vLLM needs the prefill chunk ({n} tokens) to be at least the largest "
                             f"--batch-size ({max(m.batch_sizes)}), its max_num_seqs")
    return replace(m, scenarios=(COLD, *others))


def resolve_auto(m: Matrix) -> Matrix:
    """`auto` device and dtype made concrete here, for the Python API and the CLI alike: a cell's
    settings (what resume compares) and the workers only ever see real values."""
    device = m.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = m.dtype if m.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    return replace(m, device=device, dtype=dtype)


def _check_in(flag: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    for v in values:
        if v not in allowed:
            raise InputError(f"{flag} {v!r}: expected one of {', '.join(allowed)}")


@dataclass(frozen=True)
class ModelShape:
    """What TP validation needs from a model's config. A size that differs from layer to layer
    (a list per layer, or per-layer overrides) is the tuple of the values it takes."""

    model_type: str
    num_attention_heads: int | tuple[int, ...]
    num_key_value_heads: int | tuple[int, ...]
    intermediate_size: int | tuple[int, ...]
    vocab_size: int
    tp_styles: dict[str, str]
    attention: str | None = None  # what makes its attention other than causal over the whole sequence
    moe_intermediate_size: int | tuple[int, ...] = 0  # an expert's MLP width, where the config names one apart


# Layer types whose attention sees other keys than every earlier one of the sequence.
_MASKED_LAYER_TYPES = ("sliding", "chunk", "sparse")


def attention_refusal(cfg) -> str | None:
    """What in the config makes attention other than causal over the whole sequence, which is
    all tbik's attention computes (None: nothing). With per-layer types the types decide; a
    window without them applies to every layer unless use_sliding_window turns it off."""
    types = getattr(cfg, "layer_types", None)
    if types:
        masked = sorted({t for t in types if any(word in str(t) for word in _MASKED_LAYER_TYPES)})
        if masked:
            return f"attention layers of type {', '.join(masked)}"
    elif getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(cfg, "attention_chunk_size", None):
        return f"chunked attention (chunks of {cfg.attention_chunk_size} tokens)"
    if getattr(cfg, "index_topk", None):
        return "indexer-selected sparse attention (DSA)"
    if getattr(cfg, "keep_window_size", None):
        return "dynamic-mask attention"
    return None


# TP styles the invariant kernel modes cover (see repaudit/kernelmodes.py). A fused experts
# module (moe_tp_experts, its gate/up weight packed_colwise) runs repaudit/run/experts.py's forward.
INVARIANT_STYLES = {"colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep",
                    "replicated_with_grad_allreduce", "embedding_rowwise", "packed_colwise", "moe_tp_experts"}


def validate_against_model(plan: Plan, shape: ModelShape, visible_devices: int | None, nnodes: int = 1) -> None:
    """Checks that need the model's config and the machine: fail in a second, not after an hour."""
    if plan.matrix.topk > shape.vocab_size:  # torch.topk would raise in every cell's job, after the model loaded
        raise InputError(f"--topk {plan.matrix.topk} exceeds the model's vocabulary ({shape.vocab_size} tokens)")
    for tp in sorted({c.tp for c in plan.cells}):
        engines = {c.engine for c in plan.cells if c.tp == tp}
        for what, n in (("attention heads", shape.num_attention_heads), ("key/value heads", shape.num_key_value_heads),
                        ("MLP width (intermediate_size)", shape.intermediate_size),
                        ("expert MLP width (moe_intermediate_size)", shape.moe_intermediate_size)):
            for value in (n if isinstance(n, tuple) else (n,)):
                if not value % tp:
                    continue
                if what != "key/value heads" or "hf" in engines:
                    raise InputError(f"--tp {tp} does not divide the model's {value} {what}")
                # vLLM gives each rank a copy of a key/value head where TP is a multiple of
                # their count (its Llama and Qwen attention); transformers' plan shards them.
                if tp % value:
                    raise InputError(f"--tp {tp} neither divides the model's {value} {what} nor is a multiple "
                                     "of them (vLLM copies a head to several ranks only then)")
        if "hf" in plan.matrix.engines and shape.vocab_size % tp and any("gather_output" in s for s in shape.tp_styles.values()):
            raise InputError(f"--tp {tp} does not divide the vocabulary ({shape.vocab_size}), which the lm_head shards")
        if visible_devices is not None and tp > visible_devices * nnodes:
            raise InputError(f"--tp {tp} needs {tp} GPUs but {visible_devices * nnodes} are visible")
        if tp > 1 and not shape.tp_styles and "hf" in plan.matrix.engines:
            raise InputError(f"model type {shape.model_type!r} has no tensor-parallel plan in transformers; use --tp 1")
    invariant = [k for k in plan.matrix.kernels if k != "stock"]
    if invariant:
        if shape.attention:
            raise InputError(f"--kernels {','.join(invariant)}: {shape.model_type}'s {shape.attention} is not covered by tbik's attention")
        if any(c.tp > 1 for c in plan.cells):
            for layer, style in sorted(shape.tp_styles.items()):
                if style not in INVARIANT_STYLES:
                    raise InputError(f"--kernels {','.join(invariant)}: layer {layer!r} (TP style {style!r}) is not covered by the tbik kernels")


def expand_with(plan: Plan, extra: Cell) -> Plan:
    """The plan plus the cell that makes the score references, placed first in its group."""
    groups = []
    for g in plan.groups:  # the baseline's group, which runs first
        if g.cells[0].group_key == extra.group_key:
            g = replace(g, cells=(extra,) + g.cells)
        groups.append(g)
    return replace(plan, cells=plan.cells + (extra,), groups=tuple(groups),
                   notes=plan.notes + (f"score references come from {extra.id} (added to the matrix)",))


def reference_pairs(plan: Plan) -> list[tuple[Cell, Cell]]:
    """(cell, reference) for every cell of the plan, in plan order; a reference is paired with itself.

    The one place that decides what each cell is compared with: summary.json, `repaudit gate`
    and `repaudit report` all use it."""
    return [(cell, plan.reference_for(cell)) for cell in plan.cells]


CELL_SETTINGS = ("engine", "tp", "batch_size", "nccl", "kernels", "mode", "scenario")


def reference_delta(cell: Cell, reference: Cell) -> str:
    """The reference's settings where they differ from the cell's: "tp=1 bs=1"."""
    delta = [f"{k}={getattr(reference, k)}" for k in CELL_SETTINGS if getattr(reference, k) != getattr(cell, k)]
    return " ".join(delta).replace("batch_size", "bs")


def plan_from_manifest(data) -> Plan:
    """The plan a run directory was made with, rebuilt from its manifest (a rundir.ManifestData:
    matrix, baseline and the score-reference cell that `repaudit run` adds when the matrix lacks it)."""
    try:
        matrix = Matrix.from_manifest(data.matrix, data.model["id"], data.baseline)
    except (KeyError, TypeError) as exc:
        raise InputError(f"manifest has no complete matrix (missing {exc}); was the run started?") from None
    plan = expand(matrix)
    extra = data.reference_cell
    if extra and extra not in {c.id for c in plan.cells}:
        plan = expand_with(plan, plan.reference_source)
    return plan
