"""Step caching inside the engines: three methods, each a way to skip most of the denoiser's work on some
steps of a denoising loop.

- ``deepcache`` (U-Nets): DeepCache (Ma, Fang and Wang, "DeepCache: Accelerating Diffusion Models for Free",
  CVPR 2024), below.
- ``first-block`` (transformers): the first-block cache (ParaAttention's, diffusers' ``FirstBlockCacheConfig``).
  The first transformer block is a graph of its own (``transformer_first``); when its output residual changed
  less than a threshold (relative mean absolute change) since the last step that ran every block, the other
  blocks' residual of that step is reused, and ``transformer_rest`` is not run. See :class:`FirstBlockRun`.
- ``taylorseer`` (every family): TaylorSeer (Liu et al., 2025), the denoiser's output forecast from its last
  full steps by a Taylor series of divided differences, as diffusers' ``TaylorSeerCacheConfig`` does in its lite
  mode (which forecasts ``proj_out``, the transformer's output). It splits no graph. See :class:`TaylorSeerRun`.

:class:`StepCaching` is one call's choice of method and settings, checked once; the runs below carry one call's
state. DeepCache in detail:

A U-Net's deep features change little from one denoising step to the next. On a *full* step the
whole U-Net runs and the input of the up layer at a chosen skip branch (the *deep feature*) is kept;
on the other steps only the outer layers run: the down layers up to that branch (so its skip feature
is computed fresh) and the up layers from that branch outwards, on the deep feature of the last full
step. kasoku builds this into the engines as two components from the same weights, exported,
optimized, built, cached and parity-checked like every other component:

- ``unet_full``: the whole U-Net, returning its noise prediction and the deep feature;
- ``unet_shallow``: the outer layers, taking the deep feature as one more input.

This module is what every step-caching method shares: the names, the schedules and one call's state
(:class:`StepCacheRun`). The U-Net's graphs (which layers a skip branch runs) are the U-Net's own, in
:mod:`kasoku.architectures.deepcache`.

A schedule says which steps of one call's denoising loop are full (the first always is):
``uniform`` (the paper's 1:N: every `interval`-th step) or ``nonuniform`` (the paper's non-uniform
1:N, Section 3.3: as many full steps, denser around a centre step; see :func:`full_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .errors import KasokuError

if TYPE_CHECKING:  # torch only where a call runs: the CLI reads these names at parse time
    import torch

FULL = "unet_full"
SHALLOW = "unet_shallow"
COMPONENTS = (FULL, SHALLOW)
FEATURE = "deep_feature"
DEFAULT_BRANCH = 0  # the outermost skip branch: the reference implementation's default
SCHEDULES = ("uniform", "nonuniform")
# the first-block cache's graphs (transformers) and their tensors
FIRST = "transformer_first"
REST = "transformer_rest"
BLOCK_COMPONENTS = (FIRST, REST)
CACHED_RESIDUAL = "cached_residual"  # the rest's residual of the last full step, an input of the first graph
FIRST_HIDDEN = "first_hidden"  # the image tokens after the first block
FIRST_ENCODER = "first_encoder"  # the text tokens after the first block
FIRST_RESIDUAL = "first_residual"  # what the first block added to the image tokens: the cache's signal
REST_RESIDUAL = "rest_residual"  # what the other blocks added to them

DEEPCACHE, TAYLORSEER, FIRST_BLOCK = METHODS = ("deepcache", "taylorseer", "first-block")
GRAPHS = {DEEPCACHE: COMPONENTS, FIRST_BLOCK: BLOCK_COMPONENTS, TAYLORSEER: ()}  # the graphs each method runs
DEFAULT_ORDER = 1  # TaylorSeer's: diffusers' TaylorSeerCacheConfig.max_order
DEFAULT_WARMUP = 3  # steps TaylorSeer always computes first: diffusers' disable_cache_before_step
DEFAULT_THRESHOLD = 0.05  # the first-block cache's: diffusers' FirstBlockCacheConfig.threshold
MAX_ORDER = 4
DEFAULT_SCHEDULE = "uniform"
NONUNIFORM_POWER = 1.4  # the reference's p
NONUNIFORM_CENTER = 0.3  # c as a share of the loop: the reference's c = 15 of 50 steps



class InvalidStepCache(KasokuError, ValueError):
    """A step-caching setting that cannot be served (an interval, schedule or branch)."""


def check_interval(value: Any, name: str = "cache_interval") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidStepCache(f"`{name}` must be a positive int (1: every step computed in full, no "
                               f"caching) but is {value!r}.")
    return value


def check_schedule(value: Any, name: str = "cache_schedule") -> str:
    if value not in SCHEDULES:
        raise InvalidStepCache(f"`{name}` must be one of {', '.join(SCHEDULES)} but is {value!r}.")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StepCaching:
    """One call's step caching: the method (None: off) and its settings, checked.

    `interval` is DeepCache's and TaylorSeer's (1: every step computes), `schedule` DeepCache's, `order` and
    `warmup` TaylorSeer's (the Taylor series' highest order; the first steps always computed), `threshold` the
    first-block cache's (0: every step runs every block). Make one with :meth:`of` from a call's arguments."""

    method: str | None = None
    interval: int = 1
    schedule: str = DEFAULT_SCHEDULE
    order: int = DEFAULT_ORDER
    warmup: int = DEFAULT_WARMUP
    threshold: float = DEFAULT_THRESHOLD

    ARGUMENTS = ("cache_interval", "cache_schedule", "cache_method", "cache_threshold", "cache_order",
                 "cache_warmup")

    @classmethod
    def of(cls, methods: tuple[str, ...] = (DEEPCACHE,), *, cache_interval: int = 1,
           cache_schedule: str = DEFAULT_SCHEDULE, cache_method: str | None = None,
           cache_threshold: float | None = None, cache_order: int | None = None,
           cache_warmup: int | None = None) -> StepCaching:
        """The step caching a call's arguments ask for, on a denoiser with `methods` (its first interval method
        is the default of `cache_interval` > 1; a `cache_threshold` alone asks for the first-block cache).
        Raises :class:`InvalidStepCache` with what to do."""
        check_interval(cache_interval)
        check_schedule(cache_schedule)
        if cache_method is not None and cache_method not in METHODS:
            raise InvalidStepCache(f"`cache_method` must be one of {', '.join(METHODS)} but is {cache_method!r}.")
        if cache_threshold is not None and (isinstance(cache_threshold, bool) or
                                            not isinstance(cache_threshold, (int, float)) or
                                            not math.isfinite(cache_threshold) or cache_threshold < 0):
            raise InvalidStepCache(f"`cache_threshold` must be a number >= 0 (0: every step runs every block) but is "
                                   f"{cache_threshold!r}.")
        if cache_order is not None and (not _is_int(cache_order) or not 1 <= cache_order <= MAX_ORDER):
            raise InvalidStepCache(f"`cache_order` must be an int in 1..{MAX_ORDER} (TaylorSeer's highest order) "
                                   f"but is {cache_order!r}.")
        if cache_warmup is not None and (not _is_int(cache_warmup) or cache_warmup < 0):
            raise InvalidStepCache(f"`cache_warmup` must be an int >= 0 (the steps computed before any forecast) but "
                                   f"is {cache_warmup!r}.")
        method = cache_method
        if method is None:
            method = FIRST_BLOCK if cache_threshold is not None else (
                next((m for m in methods if m != FIRST_BLOCK), None) if cache_interval > 1 else None)
        if method is None and cache_interval > 1:
            raise InvalidStepCache(f"`cache_interval` {cache_interval}: this denoiser has no step caching; call with "
                                   "cache_interval=1.")
        if method is None:
            if cache_order is not None or cache_warmup is not None:
                raise InvalidStepCache("`cache_order` and `cache_warmup` are TaylorSeer's: give `cache_interval` > 1 "
                                       "(and cache_method='taylorseer' on a U-Net).")
            return cls()
        if method not in methods:
            raise InvalidStepCache(f"`cache_method` {method!r}: this denoiser runs {', '.join(methods) or 'none'}.")
        unread = [name for name, given, reader in (
            ("cache_threshold", cache_threshold is not None, FIRST_BLOCK),
            ("cache_interval", cache_interval != 1, (DEEPCACHE, TAYLORSEER)),
            ("cache_schedule", cache_schedule != DEFAULT_SCHEDULE, DEEPCACHE),
            ("cache_order", cache_order is not None, TAYLORSEER),
            ("cache_warmup", cache_warmup is not None, TAYLORSEER)) if given and method not in reader]
        if unread:
            raise InvalidStepCache(f"{', '.join(f'`{n}`' for n in unread)} {'is' if len(unread) == 1 else 'are'} not "
                                   f"read by the {method} cache; leave {'it' if len(unread) == 1 else 'them'} out.")
        return cls(method=method, interval=cache_interval, schedule=cache_schedule,
                   order=DEFAULT_ORDER if cache_order is None else cache_order,
                   warmup=DEFAULT_WARMUP if cache_warmup is None else cache_warmup,
                   threshold=DEFAULT_THRESHOLD if cache_threshold is None else float(cache_threshold))

    @property
    def active(self) -> bool:
        """Whether a call runs anything but the plain denoiser engine (an interval of 1 computes every step; a
        first-block cache runs its two graphs at any threshold, 0 included)."""
        return self.method == FIRST_BLOCK or (self.method is not None and self.interval > 1)

    @property
    def graphs(self) -> tuple[str, ...]:
        """The engines the method runs besides (or in place of) the plain denoiser's."""
        return GRAPHS[self.method] if self.active else ()

    def arguments(self) -> dict[str, Any]:
        """The call arguments that ask for this step caching (none when off)."""
        if not self.active:
            return {}
        if self.method == FIRST_BLOCK:
            return {"cache_method": FIRST_BLOCK, "cache_threshold": self.threshold}
        if self.method == DEEPCACHE:
            return {"cache_method": DEEPCACHE, "cache_interval": self.interval, "cache_schedule": self.schedule}
        return {"cache_method": TAYLORSEER, "cache_interval": self.interval, "cache_order": self.order,
                "cache_warmup": self.warmup}

    def __str__(self) -> str:
        if not self.active:
            return "none"
        if self.method == FIRST_BLOCK:
            return f"first-block threshold {self.threshold:g}"
        if self.method == DEEPCACHE:
            return f"deepcache interval {self.interval} ({self.schedule})"
        return f"taylorseer interval {self.interval}, order {self.order}, warmup {self.warmup}"


# ---- schedules ---------------------------------------------------------------------------------


def full_steps(length: int, interval: int, schedule: str = DEFAULT_SCHEDULE) -> tuple[int, ...]:
    """The steps (0-based) of a `length`-step denoising loop that run the whole U-Net.

    uniform: 0, N, 2N, ... (the paper's 1:N). nonuniform: the paper's non-uniform 1:N (Section 3.3),
    with as many full steps k = ceil(T / N) as the uniform schedule: i_k = l_k^p + c for l_k evenly
    spaced over [(-c)^(1/p), (T - c)^(1/p)) (signed powers), made integers and distinct, so full steps
    are densest around the centre step c = 0.3 T and sparser away from it; p starts at 1.4 and is
    lowered by 0.02 until the k integers are distinct, as the reference does (p = 1 always is: evenly
    spaced steps). The reference code raises negative numbers to fractional powers in complex numbers;
    kasoku computes the paper's formula with signed real powers."""
    check_interval(interval)
    check_schedule(schedule, "schedule")
    if interval == 1 or length <= 1:
        return tuple(range(length))
    if schedule == "uniform":
        return tuple(range(0, length, interval))
    return _nonuniform(length, math.ceil(length / interval))


def _signed_power(value: float, power: float) -> float:
    return math.copysign(abs(value) ** power, value)


def _nonuniform(length: int, count: int) -> tuple[int, ...]:
    center = round(NONUNIFORM_CENTER * length)
    for hundredths in range(round(NONUNIFORM_POWER * 100), 99, -2):
        power = hundredths / 100
        start, end = _signed_power(-center, 1 / power), _signed_power(length - center, 1 / power)
        points = (start + (end - start) * k / count for k in range(count))
        # the small epsilon keeps an integer that float rounding put just below itself
        steps = {0} | {min(length - 1, max(0, math.floor(_signed_power(x, power) + center + 1e-9))) for x in points}
        if len(steps) == count:
            return tuple(sorted(steps))
    raise AssertionError("unreachable: at p = 1 the steps are evenly spaced and distinct")


@dataclass
class StepCacheRun:
    """One pipeline call's step caching: the schedule, the step counter and the deep feature of the
    last full step. `loop_length` gives the number of U-Net calls of the call's denoising loop; it is
    read at the first step (a pipeline knows it only once its timesteps are set)."""

    interval: int
    schedule: str
    loop_length: Callable[[], int]
    step: int = 0
    feature: torch.Tensor | None = field(default=None, repr=False)
    full: frozenset[int] | None = None

    def denoise(self, stand_in: EngineRunner, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One denoising step: the full graph (its deep feature kept) or the shallow one on that feature."""
        run = stand_in._run
        if self.next_is_full():
            outputs = run(FULL, **inputs)
            self.feature = outputs[FEATURE]
            return outputs["out_sample"]
        # the shallow graph takes no ControlNet residuals: they fed the full step whose deep feature it reads
        shallow = {n: v for n, v in inputs.items() if n in stand_in._engines[SHALLOW].spec.input_names}
        return run(SHALLOW, **shallow, **{FEATURE: self.feature})["out_sample"]

    def next_is_full(self) -> bool:
        """Whether the next step runs the whole U-Net (and count it)."""
        full = self._is_full(self.step)
        self.step += 1
        return full

    def skips_next(self, _branch: str | None = None) -> bool:
        """Whether the next step runs the shallow graph only (a ControlNet need not run for it); counts nothing."""
        return not self._is_full(self.step)

    def _is_full(self, step: int) -> bool:
        if self.full is None:
            self.full = frozenset(full_steps(self.loop_length(), self.interval, self.schedule))
        return self.feature is None or step in self.full




class EngineRunner(Protocol):
    """What a run asks of the denoiser's stand-in: its engines, and `_run(component, **inputs)`, which runs one and
    returns its outputs (timed, counted and checked; see kasoku.core.standins.EngineModule)."""

    _component: str
    _engines: Mapping[str, Any]
    _cache_branch: str | None  # the branch of the step diffusers names (cache_context): each keeps its own state

    def _run(self, component: str, **inputs: torch.Tensor) -> dict[str, torch.Tensor]: ...


@dataclass
class _Forecast:
    """One branch's TaylorSeer state: its step, and the Taylor factors (the output, then its divided differences)
    of the last computed step. An output is any tree of tensors (a denoiser's `ModelOutput`, a tuple): each of its
    floating tensors is forecast, its other leaves are the last computed step's."""

    step: int = -1
    updated: int | None = None
    factors: list[list[Any]] = field(default_factory=list)  # per order, the output's leaves
    tree: Any = None

    def update(self, output: Any, order: int) -> None:
        from torch.utils import _pytree as pytree

        leaves, self.tree = pytree.tree_flatten(output)
        new = [leaves]
        if self.updated is not None:
            delta = self.step - self.updated
            for previous in self.factors[:order]:
                new.append([(now - before) / delta if _forecast(now) else now
                            for now, before in zip(new[-1], previous)])
        self.factors, self.updated = new, self.step

    def predict(self) -> Any:
        from torch.utils import _pytree as pytree

        offset = self.step - self.updated
        out = list(self.factors[0])
        for order, factors in enumerate(self.factors[1:], start=1):
            weight = offset**order / math.factorial(order)
            out = [value + factor * weight if _forecast(value) else value for value, factor in zip(out, factors)]
        return pytree.tree_unflatten(out, self.tree)


def _forecast(leaf: Any) -> bool:
    return hasattr(leaf, "is_floating_point") and leaf.is_floating_point()


@dataclass
class TaylorSeerRun:
    """One call's TaylorSeer, per branch of a step (diffusers' `cache_context`: Flux's true CFG runs "cond" and
    "uncond"; one branch elsewhere): a branch computes its first `warmup` steps, then one step in `interval` (diffusers'
    rule: step s computes when s < warmup or (s - warmup - 1) % interval == 0), and forecasts the others from the
    Taylor factors of its computed steps, up to `order`. `forecasts` counts the steps it forecast."""

    interval: int
    order: int = DEFAULT_ORDER
    warmup: int = DEFAULT_WARMUP
    forecasts: int = 0
    _states: dict[Any, _Forecast] = field(default_factory=dict, repr=False)

    def computes(self, step: int) -> bool:
        return step < self.warmup or (step - self.warmup - 1) % self.interval == 0

    def skips_next(self, branch: str | None = None) -> bool:
        """Whether the next step of `branch` is forecast (a ControlNet need not run for it); counts nothing."""
        state = self._states.get(branch)
        return state is not None and state.updated is not None and not self.computes(state.step + 1)

    def denoise(self, stand_in: EngineRunner, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.step(stand_in._cache_branch,
                         lambda: stand_in._run(stand_in._component, **inputs)["out_sample"])

    def step(self, branch: Any, compute: Callable[[], Any]) -> Any:
        """The next step of `branch`: `compute()` (the denoiser's output, any tree of tensors) on a computed step,
        else its forecast."""
        state = self._states.setdefault(branch, _Forecast())
        state.step += 1
        if state.updated is None or self.computes(state.step):
            out = compute()
            state.update(out, self.order)
            return out
        self.forecasts += 1
        return state.predict()


def relative_change(now: torch.Tensor, before: torch.Tensor) -> float:
    """mean |now - before| / mean |before|: the first-block cache's measure (diffusers')."""
    return float((now - before).abs().mean() / before.abs().mean())


@dataclass
class _BlockCache:
    """One branch's first-block cache: the first block's residual and the other blocks' of the last full step."""

    head: torch.Tensor | None = None
    tail: Any = None  # a tensor (the graphs' residual), or the residual per carried tensor (blocks on their own)


@dataclass
class FirstBlockRun:
    """One call's first-block cache. Every step runs ``transformer_first`` (the embeddings, the first block, and
    the output on its tokens plus the cached residual of the other blocks); a step whose first-block residual
    changed by more than `threshold` since the last full step (or the first step) also runs ``transformer_rest``
    (the other blocks and the output) and keeps both residuals. `skipped` counts the steps that did not."""

    threshold: float
    skipped: int = 0
    changes: list[float] = field(default_factory=list)  # each step's measured change (inf: none measured)
    _states: dict[Any, _BlockCache] = field(default_factory=dict, repr=False)

    def skips_next(self, _branch: str | None = None) -> bool:
        """Never known ahead: the first block decides, on the step itself."""
        return False

    def denoise(self, stand_in: EngineRunner, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        state = self._states.setdefault(stand_in._cache_branch, _BlockCache())
        tail = state.tail
        if tail is None:  # its value is not read on a step that runs every block; its shape is the tokens'
            import torch

            shapes = {name: tuple(value.shape) for name, value in inputs.items()}
            tail = torch.zeros(stand_in._engines[FIRST].spec.output_shapes(shapes)[FIRST_HIDDEN])
        first = stand_in._run(FIRST, **inputs, **{CACHED_RESIDUAL: tail})
        if not self.computes_rest(stand_in._cache_branch, first[FIRST_RESIDUAL]):
            return first["out_sample"]
        conditioning = {name: value for name, value in inputs.items()
                        if name not in ("hidden_states", "encoder_hidden_states")}
        rest = stand_in._run(REST, **{FIRST_HIDDEN: first[FIRST_HIDDEN], FIRST_ENCODER: first[FIRST_ENCODER]},
                             **conditioning)
        state.tail = rest[REST_RESIDUAL]
        return rest["out_sample"]

    def computes_rest(self, branch: Any, first_residual: torch.Tensor) -> bool:
        """Whether this step of `branch` runs the other blocks: its first block's residual changed by more than the
        threshold since the last step that did (diffusers' rule; always on a branch's first step). A step that
        does keeps that residual; one that does not is counted in `skipped`."""
        state = self._states.setdefault(branch, _BlockCache())
        change = math.inf if state.head is None else relative_change(first_residual, state.head)
        self.changes.append(change)
        if change <= self.threshold:
            self.skipped += 1
            return False
        state.head = first_residual
        return True

    def tail(self, branch: Any) -> Any:
        """What the other blocks added on `branch`'s last step that ran them (None before one did)."""
        return self._states.setdefault(branch, _BlockCache()).tail

    def keep_tail(self, branch: Any, residual: Any) -> None:
        self._states.setdefault(branch, _BlockCache()).tail = residual


def run_for(caching: StepCaching, loop_length: Callable[[], int]):
    """One call's run of `caching` (None when it is off); `loop_length` as :class:`StepCacheRun` reads it."""
    if not caching.active:
        return None
    if caching.method == DEEPCACHE:
        return StepCacheRun(caching.interval, caching.schedule, loop_length=loop_length)
    if caching.method == TAYLORSEER:
        return TaylorSeerRun(caching.interval, caching.order, caching.warmup)
    return FirstBlockRun(caching.threshold)
