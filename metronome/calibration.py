"""Calibration: what one model costs on one engine and one machine.

A calibration is the only thing the simulator knows about hardware. It is written by hand (the
``estimated`` presets in ``calibration/``) or measured by ``metronome-probe`` (``measured``), and it is
stored as JSON. Every field is validated on load; a missing or bad field raises
:class:`~metronome.errors.CalibrationError` naming the file and the field.

Units are in the field names: ``_s`` seconds, ``_tokens``, ``_blocks``, ``_bytes``.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from metronome.errors import CalibrationError
from metronome.jitter import JitterDraws

SCHEMA = "metronome.calibration/1"

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1}
PROVENANCE_KINDS = ("measured", "estimated")
COEFFICIENTS = ("base_s", "per_seq_s", "per_context_token_s", "per_new_token_s", "moe_experts_s",
                "per_mean_context_token_s")
# what each coefficient is charged per (the report's terms table, the probe's printout)
COEFFICIENT_UNITS = {"base_s": "per step", "per_seq_s": "per sequence", "per_context_token_s": "per context token",
                     "per_new_token_s": "per computed token", "moe_experts_s": "per share of the experts read",
                     "per_mean_context_token_s": "per context token of the step's mean sequence"}
# how a step-latency term was obtained: a vendor figure, fitted to a published measurement of real serving, a
# measurement of this project's own code, or reasoned from a model's shape without a measurement to lean on
TERM_BASES = ("datasheet", "anchored", "measured", "estimated")
# An estimated term without stated bounds ranges over value/F .. value·F: a term reasoned from a model's shape with an
# assumed efficiency or rate is rarely more than 2x off its truth where a measurement has since checked one
# (docs/gpu-pricing.md: weights 1.2-1.4x datasheet, attention 1.02-1.10x). A term known to be further off states its
# own low/high (the matmul charge; Moshi's former per-pass depformer estimate was 0.03-7x off, by serving mode).
ESTIMATE_FACTOR = 2.0


@dataclass(frozen=True)
class StepTerm:
    """One named part of a step-latency coefficient (``coefficient``, one of :data:`COEFFICIENTS`): what it
    stands for, how much, how it was obtained (``basis``, one of :data:`TERM_BASES`) and from where."""

    name: str
    coefficient: str
    value: float
    basis: str
    source: str = ""
    low: float | None = None  # the term's range (:meth:`bounds`); written to a file only when set
    high: float | None = None

    def bounds(self) -> tuple[float, float]:
        """The range the term's truth plausibly lies in: ``low``/``high`` when given; else by basis, an
        ``estimated`` term ``value/ESTIMATE_FACTOR .. value·ESTIMATE_FACTOR`` (:data:`ESTIMATE_FACTOR`), any other
        (measured: the spread between runs; datasheet/anchored: what the source supports, which the roofline states
        on each such term) ``value .. value`` when it states none."""
        if self.basis == "estimated":
            lo, hi = self.value / ESTIMATE_FACTOR, self.value * ESTIMATE_FACTOR
        else:
            lo = hi = self.value
        return (lo if self.low is None else self.low, hi if self.high is None else self.high)

    def with_value(self, value: float) -> "StepTerm":
        """The same term priced at ``value`` (its stated range kept)."""
        return replace(self, value=float(value))

    def scaled(self, factor: float) -> "StepTerm":
        """Value and stated range times ``factor``."""
        return replace(self, value=self.value * factor, low=None if self.low is None else self.low * factor,
                       high=None if self.high is None else self.high * factor)


def step_inputs(batch, context_tokens, new_tokens, moe_route):
    """What each of :data:`COEFFICIENTS` multiplies, in order, for a step of ``batch`` sequences attending over
    ``context_tokens`` and computing ``new_tokens`` (scalars or numpy arrays), on a backbone whose MoE layers route
    each token to ``moe_route`` = k/E of their experts (0 for a dense model).

    The MoE input is the expected share of the experts a step reads: each of the step's tokens picks k of E
    experts, so an expert goes unread with probability ``(1 − k/E)^new_tokens`` and the step streams
    ``E·(1 − (1 − k/E)^new_tokens)`` experts' weights once (``moe_experts_s`` prices all of them). A dense model's
    input is 0.

    The last input is the mean sequence's context, ``context_tokens / batch``: decode attention over one sequence
    is spread over that sequence's KV heads, so while a step holds few sequences they cannot fill the GPU and the
    step waits on one sequence's own KV read (a batch-1 step over 8,192 tokens of Qwen3-Omni's context read at
    about 1/24 of the GPU's bandwidth on an H200, ``docs/measured/decode_step-h200-run*.json``). Its coefficient
    prices a context token of that read; at large batches the summed read (``per_context_token_s``) dominates.
    A step of no sequence has no mean: its input is 0.

    The one statement of the model's form: :meth:`StepLatencyModel.step_s`, the fit's design matrix
    (:func:`metronome.fit.fit_step_latency`) and the simulator's compiled loop (which compiles this very
    function) all read it, so a new term is a coefficient, its unit and its input here. Plain arithmetic
    only, for the compiler."""
    # (a dense model's 0 without the power: 1 − 1^n is 0 exactly, and a power is a call into the maths library,
    # which the simulator's loop made at every step)
    moe = 1.0 - (1.0 - moe_route) ** new_tokens if moe_route else 0.0 * new_tokens
    return (1.0, batch, context_tokens, new_tokens, moe, context_tokens / (batch + (batch == 0)))


def sum_terms(terms) -> dict[str, float]:
    """Each coefficient's total over ``terms``."""
    out = dict.fromkeys(COEFFICIENTS, 0.0)
    for t in terms:
        out[t.coefficient] += t.value
    return out


@dataclass(frozen=True)
class ModelShape:
    """The attention shape that sets KV size: ``kv_bytes_per_token = 2·layers·kv_heads·head_dim·dtype_bytes``."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    max_model_len_tokens: int
    params: float = 0.0  # total parameters (weights resident on the device)
    active_params: float = 0.0  # parameters touched per token (MoE: the active experts)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class TokenStream:
    """What one real-time session feeds the engine.

    Every ``frame_period_s`` a session appends ``input_tokens_per_frame`` tokens and must get
    ``output_tokens_per_frame`` (≥ 1) generated tokens back. A frame is ``output_tokens_per_frame``
    engine steps: the first computes the input plus one position, each later one a single position, so
    KV grows by ``input + output`` tokens per frame. ``prompt_tokens`` are prefilled once at admission.
    """

    frame_period_s: float
    input_tokens_per_frame: int
    output_tokens_per_frame: int
    prompt_tokens: int = 0

    @property
    def kv_tokens_per_frame(self) -> int:
        return self.input_tokens_per_frame + self.output_tokens_per_frame

    @property
    def kv_tokens_per_s(self) -> float:
        """Tokens added to a session's KV per second of conversation."""
        return self.kv_tokens_per_frame / self.frame_period_s


@dataclass(frozen=True)
class EnginePool:
    """The engine's fixed KV block pool and scheduler budget (vLLM's names in brackets)."""

    block_size_tokens: int  # [block_size]
    num_blocks: int  # [num_gpu_blocks]
    bytes_per_block: int  # [page_size_bytes of the KV cache spec]
    max_num_batched_tokens: int = 8192  # [max_num_batched_tokens]: prefill chunk budget per step
    max_num_seqs: int = 1024  # [max_num_seqs]: requests in the engine at once, paused sessions included
    watermark_blocks: int = 0  # blocks kept free when admitting a waiting request
    reserved_blocks: int = 0  # blocks counted in num_blocks that no request ever gets (vLLM's null block)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can hold: ``num_blocks − reserved_blocks``."""
        return self.num_blocks - self.reserved_blocks


@dataclass(frozen=True)
class StepLatencyModel:
    """Latency of one engine step (form ``linear/1``; :func:`step_inputs` is its one statement)::

        step_s = base_s + per_seq_s·batch + per_context_token_s·context_tokens + per_new_token_s·new_tokens
                 + moe_experts_s·(1 − (1 − moe_route)^new_tokens)
                 + per_mean_context_token_s·context_tokens/batch

    ``batch`` is the number of sequences in the step, ``context_tokens`` the KV they attend over
    (resident tokens, summed), ``new_tokens`` the tokens computed in the step (decode positions plus
    prefill chunks). On an MoE backbone (``moe_route`` = k/E > 0) ``moe_experts_s`` streams every routed expert
    once and the step pays for the share it reads; a dense model has neither (both 0, absent from its file).
    ``per_mean_context_token_s`` prices one sequence's own KV read, what a step of few sequences waits on (0, and
    absent from the file, for a model fitted or priced without it).
    ``fitted_range`` gives the ``[min, max]`` of each input the coefficients were
    fitted on; outside it the model extrapolates and the simulator counts such steps.

    Two optional terms describe a real-time engine (``metronome-probe calibrate`` fits them from its paced runs;
    both default to off, so the model above is then exact):

    * ``frame_first_s``: extra time of a frame's first step, which starts after the engine idled between frames
      (cold caches, sleeping threads, the driver's wake-up at the tick);
    * ``jitter``: ``(p, ratio)`` points of the distribution of a step's time over the model's (median)
      prediction, from ``(0, lowest)`` to ``(1, highest)``. The simulator multiplies step ``i`` of a run by the
      ratio at ``u_i``, a uniform number hashed from (the run's seed, ``i``), so frame latency gets the tail a
      percentile-driven controller sees, and a span simulated step by step or fast-forwarded gets the same draws.
    * ``jitter_shared``, ``jitter_tau_s`` and ``jitter_frame`` (file: ``jitter_correlation: {"shared", "tau_s",
      "frame"}``): how the jitter hangs together in time. A real engine's slow steps come in spells (a busy
      neighbour, the allocator, the driver's own housekeeping), and a controller that looks at one interval's p99
      sees spells, not single steps. The draw is a Gaussian copula: step ``i``, taken while the frame clock is on
      frame ``f``, gets the normal score ``√ρ·a_f + √ρ_f·b_f + √(1−ρ−ρ_f)·z_i`` (``ρ`` = ``jitter_shared``,
      ``ρ_f`` = ``jitter_frame``; ``z_i`` hashed from (seed, ``i``), ``b_f`` from (seed, ``f``); ``a`` a unit
      AR(1) over frames with correlation ``exp(−period/τ)`` a frame), and the ratio at its normal probability.
      So every step's marginal is still ``jitter``; two steps of one frame correlate by ``ρ + ρ_f``, steps
      ``k ≥ 1`` frames apart by ``ρ·exp(−k·period/τ)``. ``ρ = ρ_f = 0`` (the default) is the independent draw.

    A calibration that is priced rather than fitted (the ``estimated`` presets) lists what its coefficients are
    made of as ``terms`` (:class:`StepTerm`: name, coefficient, value, basis, source), which must add up to
    them, and the costs an engine pays only when it runs the sink+window plugin as ``plugin_terms``
    (:meth:`with_plugin`; :meth:`Calibration.step_latency_for` applies them for a policy that
    :attr:`~metronome.kv_policy.KVPolicy.runs_plugin`).
    """

    base_s: float
    per_seq_s: float
    per_context_token_s: float
    per_new_token_s: float
    moe_experts_s: float = 0.0
    per_mean_context_token_s: float = 0.0
    fitted_range: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    form: str = "linear/1"
    fit_error: Mapping[str, float] = field(default_factory=dict)
    frame_first_s: float = 0.0
    jitter: tuple[tuple[float, float], ...] = ()
    jitter_shared: float = 0.0
    jitter_tau_s: float = 0.0
    jitter_frame: float = 0.0
    terms: tuple[StepTerm, ...] = ()
    plugin_terms: tuple[StepTerm, ...] = ()
    moe_route: float = 0.0  # k/E of the backbone's MoE layers (step_inputs); 0: dense

    def ratio(self, index, seed: int = 0) -> np.ndarray:
        """The independent jitter ratio of step(s) ``index`` (an int or an array of ints) in a run seeded
        ``seed``: :meth:`draws` without the shared part. A model with ``jitter_shared`` needs the frame of each
        step: use ``draws(seed, period).ratio(index, frame)``."""
        if self.jitter_shared or self.jitter_frame:
            raise ValueError("correlated jitter needs each step's frame: use StepLatencyModel.draws()")
        return JitterDraws(self, seed, 1.0).ratio(index, 0)

    def draws(self, seed: int, frame_period_s: float) -> JitterDraws:
        """The jitter ratios of a run seeded ``seed`` on a frame clock of ``frame_period_s`` (the sampler is
        :mod:`metronome.jitter`)."""
        return JitterDraws(self, seed, frame_period_s)

    def with_plugin(self) -> "StepLatencyModel":
        """The model of an engine running the sink+window plugin: ``plugin_terms`` added to the coefficients
        (and listed among ``terms``). A calibration measured on the engine it describes has none: its fit
        already holds whatever that engine did."""
        if not self.plugin_terms:
            return self
        add = sum_terms(self.plugin_terms)
        return replace(self, **{k: getattr(self, k) + add[k] for k in COEFFICIENTS},
                       terms=self.terms + self.plugin_terms, plugin_terms=())

    def scaled(self, factor: float) -> "StepLatencyModel":
        """The same engine ``factor`` times slower (a host measured that much slower than when it was calibrated):
        every coefficient, term and the first-step extra times ``factor``; the jitter, a ratio, stays."""
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"a speed factor must be a positive number, got {factor}")
        terms = tuple(t.scaled(factor) for t in self.terms)
        plugin = tuple(t.scaled(factor) for t in self.plugin_terms)
        return replace(self, **{k: getattr(self, k) * factor for k in COEFFICIENTS},
                       frame_first_s=self.frame_first_s * factor, terms=terms, plugin_terms=plugin)

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The coefficients in :data:`COEFFICIENTS` order (what :func:`step_inputs` pairs with)."""
        return tuple(getattr(self, k) for k in COEFFICIENTS)

    def with_terms(self, terms: tuple[StepTerm, ...], plugin_terms: tuple[StepTerm, ...] | None = None
                   ) -> "StepLatencyModel":
        """The model whose coefficients are the sums of ``terms`` (and whose plugin terms are ``plugin_terms``, the
        current ones when None)."""
        plugin = self.plugin_terms if plugin_terms is None else tuple(plugin_terms)
        return replace(self, **sum_terms(terms), terms=tuple(terms), plugin_terms=plugin)

    def step_s(self, batch, context_tokens, new_tokens):
        """Σ coefficient × :func:`step_inputs`, summed in order. Vectorised: scalars and numpy arrays alike."""
        total = 0.0
        for c, x in zip(self.coefficients, step_inputs(batch, context_tokens, new_tokens, self.moe_route)):
            total = total + c * x
        return total


# A coefficient declared with a default (a term added after files were written) reads as that default from a
# file that does not list it; the others are required.
_COEFFICIENT_DEFAULTS = {f.name: f.default for f in fields(StepLatencyModel)
                         if f.name in COEFFICIENTS and f.default is not MISSING}


@dataclass(frozen=True)
class Provenance:
    kind: str  # "measured" | "estimated"
    source: str
    hardware: str
    date: str
    engine: str = ""
    weights: str = ""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class StackPricing:
    """What one serving stack adds to the backbone's step: the terms of the frame pipeline's other stages as that
    stack runs them (batched across a step's sessions or one session at a time; CUDA graphs or eager), with what the
    stack is and what it is based on (``source``). A preset offers several (:attr:`Calibration.stacks`)."""

    name: str
    description: str
    terms: tuple[StepTerm, ...]
    source: str = ""


@dataclass(frozen=True)
class Calibration:
    """One model on one engine and machine. A priced preset offers serving stacks (``stack_options``; their names
    :attr:`stacks`): ``step_latency`` holds the backbone's terms followed by the terms of the stack in use
    (``stack``; "" for a calibration with none, e.g. a measured one), and :meth:`with_stack` swaps them."""

    name: str
    model: ModelShape
    stream: TokenStream
    engine: EnginePool
    step_latency: StepLatencyModel
    provenance: Provenance
    description: str = ""
    path: str = ""  # where it was loaded from (not serialised)
    stack: str = ""
    stack_options: tuple[StackPricing, ...] = ()

    def __post_init__(self):
        # a step model without terms is a fit (a preset's engine given a measured step model, as pooling does): it
        # holds whatever its engine's stack did, so no stack can be swapped into it
        if self.stack_options and not self.step_latency.terms:
            object.__setattr__(self, "stack", "")
            object.__setattr__(self, "stack_options", ())

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def stacks(self) -> tuple[str, ...]:
        """The names of the stacks this calibration offers (the first is the default); none once its step model is
        a fit (:meth:`__post_init__`)."""
        return tuple(s.name for s in self.stack_options)

    def stack_pricing(self, name: str) -> StackPricing:
        """Stack ``name``'s pricing; a one-line CalibrationError naming the choices when it offers none such."""
        for s in self.stack_options:
            if s.name == name:
                return s
        if not self.stacks:
            raise CalibrationError(f"calibration {self.name!r} offers no serving stacks (it prices no stage but "
                                   f"the backbone); drop --stack")
        raise CalibrationError(f"calibration {self.name!r} has no stack {name!r} (stacks: {', '.join(self.stacks)})")

    def stack_description(self, name: str) -> str:
        """What stack ``name`` is, and what it is based on."""
        s = self.stack_pricing(name)
        return f"{s.description} (based on: {s.source})" if s.source else s.description

    @property
    def backbone_terms(self) -> tuple[StepTerm, ...]:
        """``step_latency``'s terms less those of the stack in use."""
        if not self.stack:
            return self.step_latency.terms
        own = {t.name for t in self.stack_pricing(self.stack).terms}
        return tuple(t for t in self.step_latency.terms if t.name not in own)

    def with_stack(self, name: str | None) -> "Calibration":
        """This calibration priced for serving stack ``name`` (None or "": as it is)."""
        if not name or name == self.stack:
            if name:
                self.stack_pricing(name)
            return self
        new = self.stack_pricing(name)
        step = self.step_latency.with_terms(self.backbone_terms + new.terms)
        return replace(self, step_latency=step, stack=name)

    def with_term(self, name: str, value: float) -> "Calibration":
        """This calibration with every term called ``name`` (the backbone's, a stack's or the plugin's) priced at
        ``value`` and the coefficients re-summed. CalibrationError when no term has that name."""
        value = float(value)
        if not (value >= 0 and math.isfinite(value)):
            raise CalibrationError(f"term {name!r}: a term's value must be a finite number >= 0, got {value!r}")
        found = False

        def swap(terms):
            nonlocal found
            out = []
            for t in terms:
                if t.name == name:
                    found = True
                    t = t.with_value(value)
                out.append(t)
            return tuple(out)

        stacks = tuple(replace(s, terms=swap(s.terms)) for s in self.stack_options)
        terms, plugin = swap(self.step_latency.terms), swap(self.step_latency.plugin_terms)
        if not found:
            known = sorted({t.name for t in self.step_latency.terms + self.step_latency.plugin_terms}
                           | {t.name for s in self.stack_options for t in s.terms})
            raise CalibrationError(f"calibration {self.name!r} has no term {name!r}"
                                   + (f" (terms: {'; '.join(known)})" if known else " (it lists no terms)"))
        step = self.step_latency.with_terms(terms, plugin) if self.step_latency.terms else replace(
            self.step_latency, plugin_terms=plugin)
        return replace(self, step_latency=step, stack_options=stacks)

    def terms_for(self, policy) -> tuple[StepTerm, ...]:
        """Every term that prices a step of this engine serving ``policy``: the backbone's, the stack in use's, and
        the plugin's when the policy runs through the plugin (:meth:`step_latency_for`'s terms)."""
        return self.step_latency_for(policy).terms

    def step_latency_for(self, policy) -> StepLatencyModel:
        """The step-latency model of this engine serving ``policy`` (a :class:`~metronome.kv_policy.KVPolicy`):
        with the plugin's terms when the policy runs through the plugin."""
        return self.step_latency.with_plugin() if policy.runs_plugin else self.step_latency

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("path")
        stack, options = d.pop("stack"), d.pop("stack_options")
        if options:  # files without stacks stay as they were
            d["stack"] = stack
            d["stacks"] = [{**o, "terms": [_term_dict(t) for t in o["terms"]]} for o in options]
        d["provenance"]["notes"] = list(self.provenance.notes)
        d["step_latency"]["fitted_range"] = {k: list(v) for k, v in self.step_latency.fitted_range.items()}
        d["step_latency"]["fit_error"] = dict(self.step_latency.fit_error)
        d["step_latency"]["jitter"] = [list(pt) for pt in self.step_latency.jitter]
        sl = d["step_latency"]
        shared, tau, frame = sl.pop("jitter_shared"), sl.pop("jitter_tau_s"), sl.pop("jitter_frame")
        if shared or frame:
            sl["jitter_correlation"] = {"shared": shared, "tau_s": tau, **({"frame": frame} if frame else {})}
        if not self.step_latency.jitter and not self.step_latency.frame_first_s:  # files stay as they were
            d["step_latency"].pop("jitter")
            d["step_latency"].pop("frame_first_s")
        for key in ("terms", "plugin_terms"):
            sl[key] = [_term_dict(t) for t in sl[key]]
            if not sl[key]:
                sl.pop(key)
        for key in ("moe_experts_s", "moe_route", "per_mean_context_token_s"):  # files without them stay as they were
            if not sl[key]:
                sl.pop(key)
        return {"schema": SCHEMA, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def _term_dict(t: Mapping[str, Any]) -> dict[str, Any]:
    """A term as a file holds it: its range only when stated."""
    return {k: v for k, v in t.items() if not (k in ("low", "high") and v is None)}


# --------------------------------------------------------------------------------------------------
# Validation


class _Reader:
    """Reads typed fields out of a JSON object, raising one-line errors that name file and field."""

    def __init__(self, origin: str, obj: Any, prefix: str = ""):
        self.origin, self.obj, self.prefix = origin, obj, prefix
        if not isinstance(obj, Mapping):
            if not prefix:
                raise CalibrationError(f"{origin}: a calibration must be a JSON object")
            raise CalibrationError(f"{origin}: field '{prefix.rstrip('.')}': must be a JSON object")

    def _fail(self, key: str, why: str):
        raise CalibrationError(f"{self.origin}: field '{self.prefix}{key}': {why}")

    def section(self, key: str) -> "_Reader":
        if key not in self.obj:
            self._fail(key, "missing")
        return _Reader(self.origin, self.obj[key], f"{self.prefix}{key}.")

    def get(self, key: str, kind: type, *, default: Any = ..., positive=False, nonneg=False):
        name = key
        if key not in self.obj or self.obj[key] is None:
            if default is ...:
                self._fail(name, "missing")
            return default
        v = self.obj[key]
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or float(v) != int(v):
                self._fail(name, f"must be an integer, got {v!r}")
            v = int(v)
        elif kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                self._fail(name, f"must be a finite number, got {v!r}")
            v = float(v)
        elif kind is str:
            if not isinstance(v, str):
                self._fail(name, f"must be a string, got {v!r}")
        if positive and not v > 0:
            self._fail(name, f"must be > 0, got {v!r}")
        if nonneg and v < 0:
            self._fail(name, f"must be >= 0, got {v!r}")
        return v


def _jitter(sl: "_Reader") -> tuple[tuple[float, float], ...]:
    raw = sl.obj.get("jitter") or []
    bad = "must be a list of [p, ratio] points with p rising from 0 to 1 and positive, non-decreasing ratios"
    if not isinstance(raw, list):
        sl._fail("jitter", bad)
    pts = []
    for v in raw:
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
            sl._fail("jitter", f"{bad}, got {v!r}")
        pts.append((float(v[0]), float(v[1])))
    if not pts:
        return ()
    p = [a for a, _ in pts]
    r = [b for _, b in pts]
    if (len(pts) < 2 or p[0] != 0.0 or p[-1] != 1.0 or any(b <= a for a, b in zip(p, p[1:]))
            or r[0] <= 0 or any(b < a for a, b in zip(r, r[1:]))):
        sl._fail("jitter", bad)
    return tuple(pts)


def _jitter_correlation(sl: "_Reader") -> dict[str, float]:
    raw = sl.obj.get("jitter_correlation")
    if raw is None:
        return {}
    c = sl.section("jitter_correlation")
    shared = c.get("shared", float, nonneg=True)
    if not shared < 1:
        c._fail("shared", f"must be in [0, 1), got {shared!r}")
    tau = c.get("tau_s", float, positive=True)
    frame = c.get("frame", float, default=0.0, nonneg=True)
    if not shared + frame < 1:
        c._fail("frame", f"shared + frame must be < 1, got {shared!r} + {frame!r}")
    if (shared or frame) and not sl.obj.get("jitter"):
        sl._fail("jitter_correlation", "needs the jitter distribution (step_latency.jitter) it correlates")
    return {"jitter_shared": shared, "jitter_tau_s": tau, "jitter_frame": frame}


def _terms(sl: "_Reader", key: str) -> tuple[StepTerm, ...]:
    raw = sl.obj.get(key) or []
    if not isinstance(raw, list):
        sl._fail(key, "must be a list of {name, coefficient, value, basis, source} objects")
    out = []
    for k, item in enumerate(raw):
        t = _Reader(sl.origin, item, f"{sl.prefix}{key}[{k}].")
        coefficient, basis = t.get("coefficient", str), t.get("basis", str)
        if coefficient not in COEFFICIENTS:
            t._fail("coefficient", f"must be one of {', '.join(COEFFICIENTS)}, got {coefficient!r}")
        if basis not in TERM_BASES:
            t._fail("basis", f"must be one of {', '.join(TERM_BASES)}, got {basis!r}")
        value = t.get("value", float, nonneg=True)
        low, high = t.get("low", float, default=None, nonneg=True), t.get("high", float, default=None, nonneg=True)
        if low is not None and low > value:
            t._fail("low", f"must be <= value ({value!r}), got {low!r}")
        if high is not None and high < value:
            t._fail("high", f"must be >= value ({value!r}), got {high!r}")
        out.append(StepTerm(name=t.get("name", str), coefficient=coefficient, value=value, basis=basis,
                            source=t.get("source", str, default=""), low=low, high=high))
    return tuple(out)


def _stacks(r: "_Reader", step: StepLatencyModel) -> dict[str, Any]:
    """The serving stacks a file offers and the one its ``step_latency`` is priced for (whose terms it must list)."""
    raw = r.obj.get("stacks")
    if raw is None:
        if r.obj.get("stack"):
            r._fail("stack", "names a stack but the file lists no stacks")
        return {}
    if not isinstance(raw, list) or not raw:
        r._fail("stacks", "must be a non-empty list of {name, description, source, terms} objects")
    options = []
    for k, item in enumerate(raw):
        s = _Reader(r.origin, item, f"stacks[{k}].")
        name = s.get("name", str)
        if not name or name in {o.name for o in options}:
            s._fail("name", f"must be a non-empty name no other stack has, got {name!r}")
        options.append(StackPricing(name=name, description=s.get("description", str, default=""),
                                    terms=_terms(s, "terms"), source=s.get("source", str, default="")))
    stack = r.get("stack", str, default=options[0].name)
    chosen = [o for o in options if o.name == stack]
    if not chosen:
        r._fail("stack", f"must be one of the listed stacks ({', '.join(o.name for o in options)}), got {stack!r}")
    have = {t.name: t for t in step.terms}
    for t in chosen[0].terms:
        if have.get(t.name) != t:
            r._fail("stack", f"stack {stack!r}'s term {t.name!r} is not among step_latency.terms as the stack lists it")
    return {"stack": stack, "stack_options": tuple(options)}


def _moe_route(sl: "_Reader") -> float:
    route = sl.get("moe_route", float, default=0.0, nonneg=True)
    if not route < 1:
        sl._fail("moe_route", f"must be k/E of the MoE layers, in [0, 1), got {route!r}")
    return route


def _check_terms(sl: "_Reader", step: StepLatencyModel) -> None:
    """Terms, when a file lists them, must add up to the coefficients they explain (1e-9 relative: the
    arithmetic of a sum written out with 17 digits)."""
    if not step.terms:
        return
    total = sum_terms(step.terms)
    for k in COEFFICIENTS:
        have = getattr(step, k)
        if not math.isclose(total[k], have, rel_tol=1e-9, abs_tol=1e-15):
            sl._fail("terms", f"the terms of {k} add up to {total[k]!r}, not {have!r}")


def from_dict(obj: Any, origin: str = "<calibration>") -> Calibration:
    """Validate a parsed JSON object and build a :class:`Calibration`."""
    r = _Reader(origin, obj)
    schema = r.get("schema", str, default=SCHEMA)
    if schema != SCHEMA:
        r._fail("schema", f"unsupported schema {schema!r} (this version reads {SCHEMA!r})")

    m = r.section("model")
    dtype = m.get("kv_dtype", str)
    if dtype not in DTYPE_BYTES:
        m._fail("kv_dtype", f"unknown dtype {dtype!r} (one of {', '.join(sorted(DTYPE_BYTES))})")
    model = ModelShape(
        name=m.get("name", str),
        layers=m.get("layers", int, positive=True),
        kv_heads=m.get("kv_heads", int, positive=True),
        head_dim=m.get("head_dim", int, positive=True),
        kv_dtype=dtype,
        max_model_len_tokens=m.get("max_model_len_tokens", int, positive=True),
        params=m.get("params", float, default=0.0, nonneg=True),
        active_params=m.get("active_params", float, default=0.0, nonneg=True),
    )

    s = r.section("stream")
    stream = TokenStream(
        frame_period_s=s.get("frame_period_s", float, positive=True),
        input_tokens_per_frame=s.get("input_tokens_per_frame", int, nonneg=True),
        output_tokens_per_frame=s.get("output_tokens_per_frame", int, positive=True),
        prompt_tokens=s.get("prompt_tokens", int, default=0, nonneg=True),
    )

    e = r.section("engine")
    engine = EnginePool(
        block_size_tokens=e.get("block_size_tokens", int, positive=True),
        num_blocks=e.get("num_blocks", int, positive=True),
        bytes_per_block=e.get("bytes_per_block", int, positive=True),
        max_num_batched_tokens=e.get("max_num_batched_tokens", int, default=8192, positive=True),
        max_num_seqs=e.get("max_num_seqs", int, default=1024, positive=True),
        watermark_blocks=e.get("watermark_blocks", int, default=0, nonneg=True),
        reserved_blocks=e.get("reserved_blocks", int, default=0, nonneg=True),
    )
    if engine.reserved_blocks >= engine.num_blocks:
        e._fail("reserved_blocks", f"must be below num_blocks ({engine.num_blocks})")
    if engine.watermark_blocks >= engine.usable_blocks:
        e._fail("watermark_blocks", f"must be below the usable blocks ({engine.usable_blocks})")
    if stream.input_tokens_per_frame + 1 > engine.max_num_batched_tokens:
        e._fail("max_num_batched_tokens", "smaller than one frame's first step")

    sl = r.section("step_latency")
    form = sl.get("form", str, default="linear/1")
    if form != "linear/1":
        sl._fail("form", f"unknown step-latency form {form!r} (this version reads 'linear/1')")
    fitted: dict[str, tuple[float, float]] = {}
    raw_range = sl.obj.get("fitted_range") or {}
    if not isinstance(raw_range, Mapping):
        sl._fail("fitted_range", "must be an object of [min, max] pairs")
    for k, v in raw_range.items():
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) or v[0] > v[1]):
            sl._fail(f"fitted_range.{k}", f"must be [min, max] with min <= max, got {v!r}")
        fitted[k] = (float(v[0]), float(v[1]))
    fit_error = sl.obj.get("fit_error") or {}
    if not isinstance(fit_error, Mapping):
        sl._fail("fit_error", "must be an object")
    step = StepLatencyModel(
        **{k: sl.get(k, float, nonneg=True, default=_COEFFICIENT_DEFAULTS.get(k, ...)) for k in COEFFICIENTS},
        fitted_range=fitted,
        form=form,
        fit_error={str(k): float(v) for k, v in fit_error.items()},
        frame_first_s=sl.get("frame_first_s", float, default=0.0, nonneg=True),
        jitter=_jitter(sl),
        **_jitter_correlation(sl),
        terms=_terms(sl, "terms"),
        plugin_terms=_terms(sl, "plugin_terms"),
        moe_route=_moe_route(sl),
    )
    _check_terms(sl, step)
    if step.step_s(1, 0, 1) <= 0:
        sl._fail("base_s", "a step must take some time: base_s + per_seq_s + per_new_token_s is 0")

    p = r.section("provenance")
    kind = p.get("kind", str)
    if kind not in PROVENANCE_KINDS:
        p._fail("kind", f"must be one of {', '.join(PROVENANCE_KINDS)}, got {kind!r}")
    notes = p.obj.get("notes") or []
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        p._fail("notes", "must be a list of strings")
    prov = Provenance(
        kind=kind,
        source=p.get("source", str),
        hardware=p.get("hardware", str),
        date=p.get("date", str),
        engine=p.get("engine", str, default=""),
        weights=p.get("weights", str, default=""),
        notes=tuple(notes),
    )
    return Calibration(
        name=r.get("name", str),
        model=model,
        stream=stream,
        engine=engine,
        step_latency=step,
        provenance=prov,
        description=r.get("description", str, default=""),
        path=origin,
        **_stacks(r, step),
    )


# --------------------------------------------------------------------------------------------------
# Presets and loading

PRESET_PACKAGE = "metronome.presets"  # the repository's calibration/ folder, installed as package data


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESET_PACKAGE).iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> Calibration:
    f = resources.files(PRESET_PACKAGE) / f"{name}.json"
    if not f.is_file():
        raise CalibrationError(f"unknown calibration preset {name!r} (presets: {', '.join(preset_names())})")
    return _parse(f.read_text(), f"calibration/{name}.json")


def load_file(path: str | Path) -> Calibration:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise CalibrationError(f"{p}: no such calibration file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{p}: cannot read calibration file ({exc.__class__.__name__})") from None
    return _parse(text, str(p))


STACK_SEP = "@"  # a calibration spec NAME_OR_PATH@STACK names the serving stack too (what --stack makes of a name)


def split_spec(spec: str | Path) -> tuple[str, str | None]:
    """``(name or path, stack or None)`` of a calibration spec ``NAME_OR_PATH[@STACK]`` (an existing file whose name
    holds the separator is a path)."""
    s = str(spec)
    if STACK_SEP in s and not Path(s).is_file():
        name, _, stack = s.rpartition(STACK_SEP)
        return name, stack or None
    return s, None


def with_stack_spec(spec: str, stack: str) -> str:
    """The spec of calibration ``spec`` priced for ``stack`` (replacing any stack the spec names)."""
    return f"{split_spec(spec)[0]}{STACK_SEP}{stack}"


def load(name_or_path: str | Path, stack: str | None = None) -> Calibration:
    """A preset name (``moshi-7b-h200``) or a path to a calibration JSON file, either optionally followed by
    ``@STACK``, priced for serving stack ``stack`` (else the spec's; None: the one the file is priced for, its
    default). An unknown stack is a one-line CalibrationError naming the choices."""
    s, spec_stack = split_spec(name_or_path)
    if s.endswith(".json") or "/" in s or Path(s).is_file():
        cal = load_file(s)
    else:
        cal = load_preset(s)
    return cal.with_stack(stack or spec_stack)


def _parse(text: str, origin: str) -> Calibration:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{origin}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    return from_dict(obj, origin)
