"""Conformance for PyTorch: every scenario in torch x every applicable operator x every
torch backend (both modes, their batch sizes, every ``SecondOrder`` combination of the
two, ``auto``, finite differences alone and over a torch inner), in process.

The functions are ``tests/torch_scenarios.py``'s (the scenarios rewritten in torch);
the references are the scenarios' hand-written numpy ones. Exact backends must agree
to ``rtol=1e-10`` in float64; finite differences to the tolerances of
``test_conformance.py``. Results come back as torch tensors of x's dtype.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dxserve  # noqa: E402
from dxcontract.errors import UnsupportedOperatorError  # noqa: E402
from dxcontract.operators import OPERATORS  # noqa: E402
from dxserve import FiniteDifferences, SecondOrder, TorchForward, TorchReverse  # noqa: E402

try:  # imported as a top-level module by pytest (tests/ has no __init__.py)
    import scenarios as sc
    import torch_scenarios as tsc
except ImportError:  # pragma: no cover
    from tests import scenarios as sc
    from tests import torch_scenarios as tsc

pytestmark = pytest.mark.torch

RTOL = 1e-10
ATOL = 1e-12
FD_RTOL = {"central": 1e-8, "central-over-exact": 1e-8, "central-over-central": 1e-5}

FWD, REV = TorchForward(), TorchReverse()
EXACT = {
    "torch-forward": "torch-forward",
    "torch-reverse": "torch-reverse",
    "auto": "auto",
    "fwd-bs2": TorchForward(batch_size=2),
    "rev-bs3": TorchReverse(batch_size=3),
    "so(fwd,rev)": SecondOrder(FWD, REV),
    "so(rev,rev)": SecondOrder(REV, REV),
    "so(rev,fwd)": SecondOrder(REV, FWD),
    "so(fwd,fwd)": SecondOrder(FWD, FWD),
}
# id -> (backend, tolerance of first-order operators, of second-order ones)
FD = {
    "fd-central": ("finite-differences", "central", "central-over-central"),
    "so(fd,rev)": (SecondOrder(FiniteDifferences(), REV), None, "central-over-exact"),
    "so(fd,fwd)": (SecondOrder(FiniteDifferences(), FWD), None, "central-over-exact"),
}
BACKENDS = {**EXACT, **{k: v[0] for k, v in FD.items()}}


def _tolerance(bid: str, op: str) -> tuple[float, float, bool]:
    order = OPERATORS[op].order
    if bid in EXACT or order == 0:
        return RTOL, ATOL, False
    _, first, second = FD[bid]
    rtol = FD_RTOL[second if order == 2 else first]
    return rtol, rtol, True


def _cases() -> list:
    cases = []
    for s in tsc.SCENARIOS:
        for bid, backend in BACKENDS.items():
            for op in sc.DERIVATIVE_OPERATORS:
                if not sc.applies(s, op):
                    continue
                raises = isinstance(backend, SecondOrder) and OPERATORS[op].order <= 1
                cases.append(pytest.param(s, op, bid, raises, id=f"{s.name}-{op}-{bid}"))
    return cases


def _numpy(tree):
    """Tensors (and tuples/dicts of them) as numpy, checking each is a tensor."""
    if isinstance(tree, tuple | list):
        return tuple(_numpy(v) for v in tree)
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    assert isinstance(tree, torch.Tensor), type(tree)
    assert tree.dtype == torch.float64, tree.dtype
    return tree.numpy()


@pytest.mark.parametrize(("s", "op", "bid", "raises"), _cases())
def test_operator(s: sc.Scenario, op: str, bid: str, raises: bool) -> None:
    backend = BACKENDS[bid]
    tangents = sc.tangents(s, op)
    args = (s.x,) if tangents is None else (s.x, tangents)
    fn = getattr(dxserve, op)
    if raises:
        with pytest.raises(UnsupportedOperatorError) as info:
            fn(s.f, backend, *args, *s.contexts)
        assert info.value.field == "backend"
        return
    got = _numpy(fn(s.f, backend, *args, *s.contexts))
    rtol, atol, scaled = _tolerance(bid, op)
    sc.assert_close(got, sc.expected(s, op, tangents), rtol=rtol, atol=atol, scaled=scaled,
                    path=op)
    if tangents is not None:  # the batch (t, -t) gives (r, -r)
        results = got[-1] if len(OPERATORS[op].results) > 1 else got
        sc.assert_close(results[1], sc.tree_map(np.negative, results[0]),
                        rtol=max(rtol, 1e-12), atol=1e-12, scaled=scaled, path=f"{op}[1]")


@pytest.mark.parametrize("op", ["gradient", "hvp", "jacobian", "pullback"])
def test_auto_picks_the_torch_modes(op: str) -> None:
    s = tsc.BY_NAME["torch_rosenbrock" if op in ("gradient", "hvp") else "torch_vv_grow"]
    picked = dxserve.resolve("auto", op, s.f, s.x, *s.contexts)
    want = {"gradient": REV, "hvp": SecondOrder(FWD, REV),
            "jacobian": FWD, "pullback": REV}[op]  # vv_grow: n = 3 <= m = 7, forward
    assert picked == want
    assert dxserve.resolve("torch-forward", "hessian", s.f, s.x) == SecondOrder(FWD, REV)
