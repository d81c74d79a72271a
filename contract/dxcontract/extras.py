"""What to install for an optional feature: the lines every ``ImportError`` hint names.

Neither package is on a package index, so a hint names two lines that work: the
feature's own requirements by name (read from the installed distribution's metadata,
so they match its ``pyproject.toml``), and the extra itself installed from a clone of
the dxserve repository (``pip install './clients/python[progress]'``).
"""

from __future__ import annotations

import re
import shlex
from importlib.metadata import PackageNotFoundError, requires

#: The client's distribution, and how a clone's root installs it with an extra.
CLIENT = ("dxserve-client", "./contract ./clients/python[{extra}]")
#: The server's distribution (installed editable from the repository root).
SERVER = ("dxserve", "-e .[{extra}]")


def extra_requirements(distribution: str, extra: str) -> list[str]:
    """The requirements ``distribution``'s ``extra`` adds (``["tqdm<5,>=4.60"]``), from
    its installed metadata; empty when it is not installed (a source tree on the path)."""
    try:
        declared = requires(distribution) or []
    except PackageNotFoundError:
        return []
    marker = re.compile(r"""extra\s*==\s*["']""" + re.escape(extra) + r"""["']""")
    found = []
    for line in declared:
        requirement, _, condition = line.partition(";")
        if marker.search(condition):
            found.append(requirement.strip())
    return found


def install_hint(extra: str, package: tuple[str, str] = CLIENT) -> str:
    """``pip install 'tqdm<5,>=4.60' (or, at the root of a dxserve clone: pip install
    './clients/python[progress]')``: lines that install ``package``'s ``extra``."""
    distribution, from_clone = package
    clone = "pip install " + " ".join(
        shlex.quote(word) for word in from_clone.format(extra=extra).split()
    )
    names = extra_requirements(distribution, extra)
    if not names:
        return f"at the root of a dxserve clone: {clone}"
    named = " ".join(shlex.quote(n) for n in names)
    return f"pip install {named} (or, at the root of a dxserve clone: {clone})"
