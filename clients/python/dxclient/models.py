"""Models as functions: Equinox ``Module``s and Flax NNX modules as ``x``.

``client.register(loss, model, *data)`` and every operator accept the model itself.
The client splits it locally into its differentiable arrays and the rest:

* Equinox: ``eqx.partition(model, eqx.is_inexact_array)``: the floating arrays are
  the parameters; everything else (activation functions, ints, integer arrays, other
  static fields) is folded into the export as constants.
* Flax NNX: ``nnx.split(model, nnx.Param, ...)``: ``nnx.Param`` values are the
  parameters; the graph definition and the other state (RNG counters, batch
  statistics) are folded into the export.

On the wire ``x`` is the **list of parameter leaves** in ``jax.tree_util.tree_flatten``
order (a list node of arrays, which every encoding already carries), so the server
sees an ordinary pytree function ``f(leaves, *data)``. Results shaped like ``x``
(``gradient``, ``hvps``, ``pullbacks``, ``hessian``'s blocks) are rebuilt into the
model's structure: for Equinox a ``Module`` with gradient leaves and ``None`` elsewhere
(what ``eqx.filter_grad`` returns, so ``eqx.apply_updates(model, updates)`` works), for
NNX an ``nnx.State`` of the parameters (what ``nnx.grad`` returns, so
``nnx.update(model, new_params)`` works). Tangents given as models (``hvp``,
``pushforward``) are split the same way. ``jacobian`` blocks and values shaped like
``f(x)`` come back as the wire gives them.

Detection is cheap: a value is a model only if ``equinox`` or ``flax.nnx`` is already
imported (``sys.modules``), so a client that never uses them never imports them.
A Flax Linen parameter tree (``variables["params"]``) is a plain dict pytree and needs
nothing from here.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dxcontract.operators import returned, unreturned

#: Results whose arrays are shaped like ``x`` (one result) or like ``x`` each (batches).
_X_SHAPED = frozenset({"gradient"})
_X_SHAPED_BATCH = frozenset({"hvps", "pullbacks"})


def is_model(value: Any) -> bool:
    """Whether ``value`` is an Equinox or Flax NNX module (only if their package is loaded)."""
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(value, eqx.Module):
        return True
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(value, nnx.Module)


@dataclass(frozen=True)
class Split:
    """A model taken apart: its parameter leaves, their tree, and how to put it back."""

    leaves: list[Any]
    treedef: Any  # the PyTreeDef of the parameters (a model with None at static leaves)
    combine: Callable[[Any], Any]  # parameters pytree -> the whole model (traceable)

    def rebuild(self, leaves: Any) -> Any:
        """A list of leaves shaped like ``self.leaves`` -> the parameters' structure."""
        return self.treedef.unflatten(list(leaves))


def split(model: Any) -> Split:
    """Split an Equinox or NNX ``model`` into its parameters and the rest."""
    import jax

    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(model, eqx.Module):
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def combine(p: Any) -> Any:
            return eqx.combine(p, static)
    else:
        from flax import nnx

        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def combine(p: Any) -> Any:
            return nnx.merge(graphdef, p, rest)

    leaves, treedef = jax.tree_util.tree_flatten(params)
    if not leaves:
        raise ValueError(f"{type(model).__name__} has no floating-point parameters")
    return Split(leaves, treedef, combine)


def _leaves(split_: Split, value: Any) -> list[Any]:
    """``value`` (a model, or already a list of leaves) as numpy leaves of ``split_``'s tree."""
    import jax

    if is_model(value):
        value = split(value).leaves
    elif not isinstance(value, list):  # a parameters pytree (a filter_grad result, a State)
        value = jax.tree_util.tree_leaves(value)
    if len(value) != len(split_.leaves):
        raise ValueError(
            f"expected {len(split_.leaves)} parameter leaves like the model, got {len(value)}"
        )
    return [np.asarray(v) for v in value]


def for_export(fn: Callable[..., Any], example_args: tuple) -> tuple[Callable[..., Any], tuple]:
    """``fn(model, *data)`` as ``g(leaves, *data)`` with the model's static part closed over."""
    s = split(example_args[0])

    def exported(leaves: list[Any], *data: Any) -> Any:
        return fn(s.combine(s.rebuild(leaves)), *data)

    exported.__name__ = getattr(fn, "__name__", "model_loss")
    return exported, ([np.asarray(v) for v in s.leaves], *example_args[1:])


@dataclass(frozen=True)
class ModelCall:
    """An operator call on a model: what to send, and how to shape what comes back."""

    split: Split
    x: list[Any]
    tangents: Any

    def finish(self, operator: str, result: Any, has_aux: bool = False) -> Any:
        """Rebuild ``result`` (or, for ``AsyncClient``, the awaited result); a has_aux
        call's aux is left as it came."""
        if inspect.isawaitable(result):
            return self._finish_async(operator, result, has_aux)
        return self._rebuild(operator, result, has_aux)

    async def _finish_async(self, operator: str, result: Any, has_aux: bool) -> Any:
        return self._rebuild(operator, await result, has_aux)

    def _rebuild(self, operator: str, result: Any, has_aux: bool = False) -> Any:
        from ._models import operator_spec

        op = operator_spec(operator)
        names = op.results
        values = unreturned(op, result, has_aux)
        out = []
        for name, value in zip(names, values[:len(names)], strict=True):
            if name in _X_SHAPED:
                value = self.split.rebuild(value)
            elif name in _X_SHAPED_BATCH:
                value = tuple(self.split.rebuild(v) for v in value)
            elif name == "hessian":  # H[i][j]: leaf i by leaf j, nested as the model twice
                value = self.split.rebuild([self.split.rebuild(row) for row in value])
            out.append(value)
        return returned(op, (*out, *values[len(names):]), has_aux)


def model_call(x: Any, tangents: Any) -> ModelCall | None:
    """A ``ModelCall`` when ``x`` is a model, else None (the hot path: two dict lookups)."""
    if not is_model(x):
        return None
    s = split(x)
    if tangents is not None:
        tangents = tuple(_leaves(s, t) if is_model(t) else t for t in tangents)
    return ModelCall(s, [np.asarray(v) for v in s.leaves], tangents)


__all__ = ["ModelCall", "Split", "for_export", "is_model", "model_call", "split"]
