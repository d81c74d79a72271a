"""Complex numbers in JAX's convention on every engine: each complex leaf as its real
and imaginary parts.

For z = x + iy, JAX's transformations answer:

* pushforward (``jax.jvp``): ``t -> ∂f/∂x Re t + ∂f/∂y Im t`` (``f'(z) t`` for holomorphic f);
* pullback (``jax.vjp``): the transpose of that map under the real pairing
  ``<c, w> = Re Σ c w``: ``c -> (∂/∂x - i ∂/∂y) Re Σ c f``. The gradient of a
  real-valued f is its pullback of 1, ``∂f/∂x - i ∂f/∂y``; of a holomorphic f, ``f'(z)``;
* jacobian and derivative: ``jax.jacrev``'s ``∂f/∂x - i ∂f/∂y`` for a real-valued f of
  complex x, ``jax.jacfwd``'s ``∂f/∂x`` for a complex-valued f (``f'(z)`` where f is
  holomorphic, as ``holomorphic=True`` gives it). A pytree-valued f with any complex
  leaf counts as complex-valued: every block along the real parts (JAX refuses these);
* hessian and second_derivative: that Jacobian of the gradient (of the derivative), so
  ``jax.jacfwd(jax.grad(f), holomorphic=True)``, whose columns are the HVPs along the
  real basis; hvp: ``jax.jvp(jax.grad(f))``.

``RealParts(engine)`` hands an engine the real problem behind a complex one: every
complex leaf of x, and of f(x), becomes a real leaf with a trailing axis of two (real
part, imaginary part). The engine differentiates that real function as any other, so
JAX's modes, finite differences (stepping along real and imaginary directions, with
the step of the real dtype under complex64/complex128) and plug-ins all answer alike,
and the answers are mapped back to JAX's convention here. An engine that evaluates
the function at complex points itself (a complex step) cannot be served so: the real
function refuses complex arguments with ``ComplexRefused``, an
``UnsupportedOperatorError`` (422).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dxcontract.errors import UnsupportedOperatorError
from dxserve.core.backends.engine import Engine, Fn, Tree
from dxserve.frameworks import Framework


class ComplexRefused(UnsupportedOperatorError):
    """The backend cannot differentiate complex numbers in JAX's convention (422): its
    answer to these inputs, not a transformation that failed to trace."""


def is_complex(leaf: Any) -> bool:
    """Does ``leaf`` (an array or its spec) hold complex numbers? (A dtype numpy does not
    know, a typed PRNG key's, is not complex.)"""
    try:
        return np.dtype(leaf.dtype).kind == "c"
    except TypeError:
        return False


def has_complex(framework: Framework, *trees: Tree) -> bool:
    """Is any leaf of ``trees`` complex?"""
    return any(is_complex(leaf) for tree in trees for leaf in framework.leaves(tree))


@dataclass(frozen=True)
class _Problem:
    """Which leaves of x and of g(x) are complex, and how to go to and from real parts."""

    ops: Framework
    name: str
    x_def: Any
    x_dtypes: tuple
    y_def: Any
    y_dtypes: tuple
    y_shapes: tuple

    @property
    def x_complex(self) -> list[bool]:
        return [np.dtype(d).kind == "c" for d in self.x_dtypes]

    @property
    def y_complex(self) -> list[bool]:
        return [np.dtype(d).kind == "c" for d in self.y_dtypes]

    # --- leaves to and from real parts (any leading axes: batches of tangents) ------
    def _split(self, leaf: Any, sign: float = 1.0) -> Any:
        xp = self.ops.xp
        return xp.stack([xp.real(leaf), sign * xp.imag(leaf)], axis=-1)

    def _join(self, leaf: Any, dtype: Any, sign: float = 1.0) -> Any:
        return (leaf[..., 0] + (sign * 1j) * leaf[..., 1]).astype(dtype)

    def _each(self, tree: Tree, flags: list[bool], fn: Callable[[Any], Any]) -> Tree:
        leaves, structure = self.ops.flatten(tree)
        return self.ops.unflatten(
            structure, [fn(v) if c else v for v, c in zip(leaves, flags, strict=True)]
        )

    def x_real(self, x: Tree) -> Tree:
        """x (or tangents of it) with each complex leaf as ``[..., (re, im)]``."""
        return self._each(x, self.x_complex, self._split)

    def x_back(self, u: Tree) -> Tree:
        leaves, structure = self.ops.flatten(u)
        return self.ops.unflatten(structure, [
            self._join(v, d) if c else v
            for v, d, c in zip(leaves, self.x_dtypes, self.x_complex, strict=True)
        ])

    def y_real(self, y: Tree) -> Tree:
        return self._each(y, self.y_complex, self._split)

    def y_back(self, v: Tree) -> Tree:
        """Values or pushforwards of the real function as g's (complex) outputs."""
        leaves, structure = self.ops.flatten(v)
        return self.ops.unflatten(structure, [
            self._join(w, d) if c else w
            for w, d, c in zip(leaves, self.y_dtypes, self.y_complex, strict=True)
        ])

    def cotangents_real(self, ty: Tree) -> Tree:
        """Cotangents of g as the real function's: ``(Re c, -Im c)`` under the pairing."""
        return self._each(ty, self.y_complex, lambda c: self._split(c, -1.0))

    def pulled_back(self, w: Tree) -> Tree:
        """The real function's pullbacks (or gradient) as JAX's: ``w_re - i w_im``."""
        leaves, structure = self.ops.flatten(w)
        return self.ops.unflatten(structure, [
            self._join(v, d, -1.0) if c else v
            for v, d, c in zip(leaves, self.x_dtypes, self.x_complex, strict=True)
        ])

    def real_fn(self, g: Fn) -> Fn:
        """g of the real parts: real leaves in, real leaves out."""
        return lambda u: self.y_real(g(self.x_back(self.refuse_complex(u))))

    def refuse_complex(self, u: Tree) -> Tree:
        if has_complex(self.ops, u):
            raise ComplexRefused(
                f"{self.name} evaluates the function at complex points (a complex step), "
                "so it cannot differentiate complex numbers by their real and imaginary "
                "parts as JAX does; use 'jax-reverse' or 'auto' (or 'finite-differences' "
                "for functions JAX cannot trace)",
                field="backend",
            )
        return u

    # --- Jacobian blocks -----------------------------------------------------------
    def block(self, b: Any, i: int, j: int, real_x: bool) -> Any:
        """JAX's Jacobian block of g's i-th output leaf in x's j-th leaf, from the real
        function's block ``b`` (shape ``y_i[, 2] + x_j[, 2]``; ``real_x``: only the real
        parts of x were differentiated, so no trailing 2)."""
        yc, xc = self.y_complex[i], self.x_complex[j] and not real_x
        if not (yc or xc):
            return b
        dtype = np.result_type(self.y_dtypes[i], self.x_dtypes[j], np.complex64)
        if xc:  # along the real part; for real-valued g, minus i times along the imaginary
            b = b[..., 0] if yc else b[..., 0] - 1j * b[..., 1]
        if yc:  # the output's real and imaginary parts, one axis after y's own
            at = (slice(None),) * len(self.y_shapes[i])
            b = b[(*at, 0)] + 1j * b[(*at, 1)]
        return b.astype(dtype)

    def blocks(self, jac: Tree, real_x: bool = False) -> Tree:
        """The real function's Jacobian (y's structure of x-structured blocks, as
        ``Engine.jacobian``) as JAX's Jacobian of g."""
        ops = self.ops
        flat = ops.leaves(jac)
        nx = len(self.x_dtypes)
        nested = []
        for i in range(len(self.y_dtypes)):
            row = [self.block(flat[i * nx + j], i, j, real_x) for j in range(nx)]
            nested.append(ops.unflatten(self.x_def, row))
        return ops.unflatten(self.y_def, nested)


def for_complex(engine: Engine, name: str) -> Engine:
    """``engine`` for a function with complex inputs or outputs: its own ``for_complex``
    form, else wrapped in ``RealParts`` (``name``: its backend, for refusals)."""
    own = engine.for_complex(name)
    return RealParts(engine, name) if own is None else own


class RealParts(Engine):
    """``engine`` differentiating complex inputs and outputs by their real and imaginary
    parts, answering in JAX's convention (see the module). Everything else (compiling,
    preparation, what it holds and reports) is ``engine``'s."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.mode = engine.mode
        self.traces = engine.traces

    # --- the wrapped engine's own -------------------------------------------------
    @property
    def traced(self) -> bool:  # type: ignore[override]
        return self.engine.traced

    @property
    def batch_size(self) -> int | None:  # type: ignore[override]
        return self.engine.batch_size

    def use(self, framework: Framework) -> Engine:
        self.engine.use(framework)
        self.framework = framework
        return self

    def prepare(self, family: str, f: Callable, inputs: Any, limits: Any = None) -> None:
        self.engine.prepare(family, f, inputs, limits)

    @property
    def nbytes(self) -> int:
        return self.engine.nbytes

    def result_elements(self, family: str, n: int, m: int, k: int) -> int | None:
        return self.engine.result_elements(family, n, m, k)

    def report(self) -> dict[str, Any]:
        return self.engine.report()

    def held_bytes(self) -> int:
        return self.engine.held_bytes()

    def compile(self, fn: Callable, args: tuple, key: Any = None) -> Callable:
        return self.engine.compile(fn, args, key)

    def for_complex(self, name: str) -> Engine:
        return self

    # --- the maths, on real parts ---------------------------------------------------
    def _problem(self, g: Fn, x: Tree) -> _Problem | None:
        """g's real problem at x, or None when neither x nor g(x) has a complex leaf."""
        ops = self.ops
        x_leaves, x_def = ops.flatten(x)
        y_leaves, y_def = ops.flatten(ops.eval_shape(g, x))
        if not any(is_complex(v) for v in (*x_leaves, *y_leaves)):
            return None
        return _Problem(
            ops, self.name, x_def, tuple(np.dtype(v.dtype) for v in x_leaves), y_def,
            tuple(np.dtype(v.dtype) for v in y_leaves), tuple(tuple(np.shape(v)) for v in y_leaves),
        )

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        p = self._problem(g, x)
        if p is None:
            return self.engine.pushforward(g, x, tx)
        y, out = self.engine.pushforward(p.real_fn(g), p.x_real(x), p.x_real(tx))
        return p.y_back(y), p.y_back(out)

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        p = self._problem(g, x)
        if p is None:
            return self.engine.pullback(g, x, ty)
        y, out = self.engine.pullback(p.real_fn(g), p.x_real(x), p.cotangents_real(ty))
        return p.y_back(y), p.pulled_back(out)

    def gradient(self, g: Fn, x: Tree) -> tuple[Any, Tree]:
        p = self._problem(g, x)
        if p is None:
            return self.engine.gradient(g, x)
        if p.y_complex[0]:  # holomorphic: the pullback of 1 (jax.grad(holomorphic=True))
            y, out = self.pullback(g, x, self.xp.ones((1,), p.y_dtypes[0]))
            return y, self.ops.tree_map(lambda leaf: leaf[0], out)
        y, grad = self.engine.gradient(p.real_fn(g), p.x_real(x))
        return p.y_back(y), p.pulled_back(grad)

    def jacobian(self, g: Fn, x: Tree) -> tuple[Tree, Tree]:
        p = self._problem(g, x)
        if p is None:
            return self.engine.jacobian(g, x)
        if any(p.y_complex):
            # A complex-valued g's Jacobian is ∂g/∂x alone: differentiate along the real
            # parts only (n columns or 2m rows, as for a real function of n inputs).
            ops, xp = self.ops, self.xp
            imag = [xp.imag(v) if c else None for v, c in zip(ops.leaves(x), p.x_complex, strict=True)]

            def along_real(r: Tree) -> Tree:
                leaves, structure = ops.flatten(p.refuse_complex(r))
                z = [(v + 1j * i).astype(d) if i is not None else v
                     for v, i, d in zip(leaves, imag, p.x_dtypes, strict=True)]
                return p.y_real(g(ops.unflatten(structure, z)))

            y, jac = self.engine.jacobian(along_real, ops.tree_map(xp.real, x))
            return p.y_back(y), p.blocks(jac, real_x=True)
        y, jac = self.engine.jacobian(p.real_fn(g), p.x_real(x))
        return p.y_back(y), p.blocks(jac)

    def derivative(self, g: Fn, x: Any) -> tuple[Tree, Tree]:
        p = self._problem(g, x)
        if p is None:
            return self.engine.derivative(g, x)
        if p.x_complex[0]:  # the Jacobian at a scalar x: y's structure and shapes
            return self.jacobian(g, x)
        y, dy = self.engine.derivative(p.real_fn(g), x)
        return p.y_back(y), p.y_back(dy)

    def symmetric_products(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        # A gradient's Jacobian is symmetric under the real pairing Re Σ c w as well:
        # JAX's vjp of a gradient along t is its jvp along t, so either direction serves.
        if self.mode == "reverse":
            return self.pullback(g, x, tx)
        return self.pushforward(g, x, tx)
