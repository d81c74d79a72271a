"""Request batching: concurrent calls of one prepared executable as one vmapped call.

Batching must be invisible: a merged call returns, for every request, the bits that
request would have got alone. XLA does not promise that of a vmapped program: on CPU
it vectorizes a [B, n] loop differently from an [n] one, so fused multiply-adds and
reduction orders change (``bench/batching_bits.py`` shows both). So a batched
executable is *earned*, per (prep, operator, bucket):

1. Programs the function's framework will not merge are never batched
   (``Framework.batch_program``). For JAX: functions with data-dependent control
   flow (``cond``, ``while``), host callbacks or uploaded exports, since vmap turns a
   ``cond`` into a select that runs both branches, which can differ (a NaN gradient
   from the branch not taken) on inputs no check has seen.
2. The first time a batch of that bucket forms, every request in it is also run
   alone; the requests are answered from those unbatched runs, and the batched
   executable is kept only if each of its rows matched bit for bit. Otherwise that
   (prep, operator, bucket) stays unbatched for good.

Buckets are powers of two (``bucket(k)``), so a key compiles at most log2(max) batched
executables; a batch is padded to its bucket by repeating its last request.

**Rounding mode** (``DXSERVE_BATCHING=rounding``, opt-in; the default ``exact`` is the
above). For users who want throughput over bitwise reproducibility: step 2's check
accepts a batched executable whose rows agree with the unbatched runs *to rounding*
instead of bit for bit, so the (prep, operator, bucket)s that ``exact`` refuses (on CPU
most sizes of most functions: ``bench/batching_bits.py``) are merged too. Agreement,
per result array, is ``agree_to_rounding``: integer and bool results equal; float and
complex results with the same non-finite values in the same places, and every finite
element within ``ROUNDING_ULPS`` (256) units of roundoff of the array's scale:
``|batched - alone| <= 256 * eps(dtype) * (|alone| + max|alone|)`` (float64: ~5.7e-14
relative to the array's largest element; float32: ~3.1e-5). Rule 1 is unchanged
(control flow is never batched: that is about which branch runs, not rounding), the
check still runs once per (prep, operator, bucket) on the first real batch, and a
batch that fails it is refused for good as in ``exact``. Answers then differ from
unbatched ones in their last bits, by at most that bound on the checked inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Inputs = tuple[Any, Any, Any]  # (x, tangents, contexts), normalized


def bucket(k: int) -> int:
    """The smallest power of two >= ``k``."""
    return 1 << max(0, k - 1).bit_length()


#: Batching modes (``Settings.batching``): bit-identical rows only, or rows equal to rounding.
MODES = ("exact", "rounding")
#: Units of roundoff (of the result's dtype) a batched row may differ by in "rounding" mode.
ROUNDING_ULPS = 256


def agree_to_rounding(a: Any, b: Any, ulps: int = ROUNDING_ULPS) -> bool:
    """``b`` equals ``a`` to rounding: same dtype and shape; integers and bools equal;
    floats/complex with NaN and infinities in the same places and every finite
    element within ``ulps * eps * (|a| + max|a|)`` (``max`` over ``a``'s finite
    elements)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind not in "fc":  # bfloat16 (kind 'V') too: 256 of its ulps are 2x
        return a.tobytes() == b.tobytes()
    finite = np.isfinite(a)
    if not np.array_equal(finite, np.isfinite(b)):
        return False
    if not np.array_equal(a[~finite], b[~finite], equal_nan=True):
        return False
    if not finite.any():
        return True
    eps = np.finfo(a.dtype).eps
    mag = np.abs(a[finite])
    bound = ulps * eps * (mag + mag.max())
    return bool((np.abs(b[finite] - a[finite]) <= bound).all())


def _bits_equal(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@dataclass(eq=False)
class _Plan:
    """What batching knows about one (prep, operator)."""

    eligible: bool
    why: str = ""
    program: Any = None  # the unbatched operator, flat in and out (``Framework.batch_program``)
    out_tree: Any = None
    arrays: list = field(default_factory=list)  # what the program keeps alive
    # (bucket, device) -> compiled batched executable, or None once it failed the bit check
    executables: dict[tuple, Any] = field(default_factory=dict)
    verified: set[tuple] = field(default_factory=set)


class Batcher:
    """Runs groups of requests that share one prep and operator.

    ``run_group(prep, operator, inputs)`` returns one result (or exception) per
    request, each exactly what ``prep.run(operator, *inputs[i])`` returns alone.
    Only device worker threads call it.
    """

    def __init__(self, mode: str = "exact") -> None:
        """``mode``: "exact" (rows bit-identical to unbatched runs) or "rounding" (rows
        equal to rounding, ``agree_to_rounding``); see the module docstring."""
        if mode not in MODES:
            raise ValueError(f"batching mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._agree = _bits_equal if mode == "exact" else agree_to_rounding
        self.batches = 0  # merged calls answered from a batched executable
        self.batched_requests = 0
        self.refused = 0  # (prep, operator, bucket)s that failed the bit check
        self.compiles = 0  # batched executables compiled (at most one per bucket per key)

    # --- plans --------------------------------------------------------------
    def plan(self, prep: Any, operator: str, inputs: Inputs) -> _Plan:
        """The plan for (prep, operator), made on first use and kept on the prep.
        ``inputs``: one request's, its tangents packed (``prep.pack``)."""
        plan = prep.batch_plans.get(operator)
        if plan is None:
            plan = prep.batch_plans[operator] = _make_plan(prep, operator, inputs)
            if plan.program is not None:
                prep.grew()  # the traced program is kept: its cache measures it again
        return plan

    # --- running ------------------------------------------------------------
    def run_group(self, prep: Any, operator: str, group: Sequence[Inputs]) -> list[Any]:
        """One result (or the exception it raised) per request in ``group``."""
        if len(group) == 1:  # the prep's own run (in a float64 scope of its own)
            return [_alone(prep, operator, group[0])]
        # batched executables trace and run as the prep's own do
        with prep.framework.precision_scope():
            return self._run_group(prep, operator, group)

    def _run_group(self, prep: Any, operator: str, group: Sequence[Inputs]) -> list[Any]:
        # batched programs take the tangents packed, as the prep's own (see ``packing``)
        packed = [(x, prep.pack(t), c) for x, t, c in group]
        plan = self.plan(prep, operator, packed[0])
        size = bucket(len(group))
        slot = (size, prep.framework.device())  # executables are bound to a device
        if not plan.eligible or plan.executables.get(slot, True) is None:
            return [_alone(prep, operator, inputs) for inputs in group]
        compiles = self.compiles
        try:
            batched = self._run_batched(plan, slot, packed, prep.limits, prep.framework)
        except Exception:  # noqa: BLE001 - e.g. out of memory at B rows: each alone says why
            return [_alone(prep, operator, inputs) for inputs in group]
        finally:
            if self.compiles != compiles:  # a batched executable is kept on the prep
                prep.grew()
        if group[0][1] is not None:
            batched = [
                prep.unpack(operator, out, len(inputs[1]))
                for out, inputs in zip(batched, group, strict=True)
            ]
        if slot in plan.verified:
            self.batches += 1
            self.batched_requests += len(group)
            return batched
        alone = [_alone(prep, operator, inputs) for inputs in group]
        if all(
            _same_result(a, b, self._agree, prep.framework)
            for a, b in zip(alone, batched, strict=True)
        ):
            plan.verified.add(slot)
        else:
            plan.executables[slot] = None
            self.refused += 1
        return alone

    def _run_batched(
        self, plan: _Plan, slot: tuple, group: Sequence[Inputs], limits: Any, framework: Any,
    ) -> list[Any]:
        rows = [framework.leaves(inputs) for inputs in group]
        rows += [rows[-1]] * (slot[0] - len(rows))  # pad to the bucket
        stacked = [np.stack(column) for column in zip(*rows, strict=True)]
        exe = plan.executables.get(slot)
        if exe is None:
            exe = plan.executables[slot] = framework.compile_batched(plan.program, stacked)
            self.compiles += 1
            if limits is not None:  # B rows cost B times one: over a bound, they run alone
                try:
                    limits.check(exe, f"a batch of {slot[0]}", framework)
                except Exception:
                    plan.executables[slot] = None
                    raise
        outputs = [np.asarray(out) for out in exe(*stacked)]
        return [
            framework.unflatten(plan.out_tree, [out[i] for out in outputs])
            for i in range(len(group))
        ]


def _make_plan(prep: Any, operator: str, inputs: Inputs) -> _Plan:
    framework = prep.framework
    if not prep.traced:
        return _Plan(False, f"not traceable by {framework.name}")
    results = prep.results(operator)

    def run(x, tangents, contexts):
        out = prep.build(x, tangents, contexts)
        return tuple(out[name] for name in results)

    program, why = framework.batch_program(run, inputs)
    if program is None:
        return _Plan(False, why)
    return _Plan(
        True, program=program, out_tree=framework.out_structure(program),
        arrays=framework.program_arrays(program),
    )


def _alone(prep: Any, operator: str, inputs: Inputs) -> Any:
    try:
        return prep.run(operator, *inputs)
    except Exception as exc:  # noqa: BLE001 - handed back to this request only
        return exc


def _same_result(alone: Any, batched: Any, agree: Any, framework: Any) -> bool:
    if isinstance(alone, BaseException):
        return False
    a, b = framework.leaves(alone), framework.leaves(batched)
    return len(a) == len(b) and all(agree(u, v) for u, v in zip(a, b, strict=True))


