"""Unmarked functions find their framework through a registered framework's ``owns``,
and a framework's ``eval_shape`` gets specs of its own kind when a function is described.

``Marked`` is a stub framework: functions whose code refers to ``markerlib`` (a module
standing for an array library such as ``autograd.numpy``) are its own. It answers only
what detection and descriptions ask (``owns``, ``spec``, ``eval_shape``).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from dxserve import frameworks
from dxserve.frameworks import detect_framework, framework_of, refers_to, register_framework
from dxserve.server.describe import facts

markerlib = types.ModuleType("markerlib")
markerlib.square = lambda v: v * v


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    dtype: np.dtype


class Marked:
    name = "marked"
    xp = np

    def __init__(self) -> None:
        self.given: list[Any] = []  # what eval_shape was handed

    def owns(self, f: Any) -> bool:
        return refers_to(f, lambda value: value is markerlib)

    def spec(self, shape: tuple[int, ...], dtype: Any) -> Spec:
        return Spec(tuple(shape), np.dtype(dtype))

    def eval_shape(self, fn: Any, *args: Any) -> Any:
        self.given.extend(args)
        out = np.asarray(fn(*[np.ones(a.shape, a.dtype) for a in args]))
        return Spec(out.shape, out.dtype)


@pytest.fixture
def marked() -> Iterator[Marked]:
    fw = register_framework(Marked())
    try:
        yield fw
    finally:
        # not a public operation: a plug-in never takes its framework back
        frameworks._FRAMEWORKS.pop(fw.name, None)
        frameworks._DETECTED.clear()


def uses_marker(x):
    return markerlib.square(x).sum()


def _helper(x):
    return markerlib.square(x)


def calls_a_helper(x):
    return _helper(x).sum()


def plain(x):
    return (x * x).sum()


def test_an_unmarked_function_of_a_registered_framework_is_its_own(marked: Marked) -> None:
    assert detect_framework(uses_marker) == "marked"
    assert framework_of(uses_marker) is marked
    assert framework_of(calls_a_helper) is marked  # through the functions it calls
    assert framework_of(lambda x: markerlib.square(x)) is marked
    assert framework_of(plain).name == "jax"  # the default is unchanged


def test_without_the_framework_the_same_function_is_jaxs() -> None:
    assert "marked" not in {fw.name for fw in frameworks.loaded_frameworks()}
    assert detect_framework(uses_marker) == "jax"


def test_registering_forgets_earlier_detections() -> None:
    assert framework_of(uses_marker).name == "jax"  # detected and cached before
    fw = register_framework(Marked())
    try:
        assert framework_of(uses_marker) is fw
    finally:
        frameworks._FRAMEWORKS.pop(fw.name, None)
        frameworks._DETECTED.clear()


def test_refers_to_walks_closures() -> None:
    lib = markerlib

    def closed(x):
        return lib.square(x)

    assert refers_to(closed, lambda v: v is markerlib)
    assert not refers_to(plain, lambda v: v is markerlib)


def test_a_description_hands_the_framework_its_own_specs(marked: Marked) -> None:
    found = facts(uses_marker, [np.ones(3)], "example", [np.ones(3)])
    assert found is not None
    assert found["output"] == {"shape": [], "dtype": "float64"}
    assert found["x"] == {"shape": [3], "dtype": "float64"}
    assert marked.given and all(type(a) is Spec for a in marked.given)
