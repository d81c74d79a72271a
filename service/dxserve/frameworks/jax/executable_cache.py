"""Persistent executable cache: a restarted server loads operators instead of re-tracing.

JAX's persistent compilation cache keys on the lowered program, so a restarted
server still traces and lowers every operator before it can look the executable
up, and for the example functions tracing and lowering are most of a first
request. This cache keys on what *determines* the program and stores the
compiled executable itself, so a later miss of the in-memory caches (after a
restart) deserializes it in a few milliseconds instead. Beside it goes the
function's output spec (``jax.eval_shape``, what ``preparation.probe`` traces
for), so a restarted server does not run the function's Python at all.

The key (``key``) is made of

* the function: a registered function of a stored kind (expression, export, ...)
  by its kind and a hash of its content (``identify``, called by the registry); a
  server-side ``@dxserve.function`` by module, qualified name and a hash of the Python
  source of its top-level package
  (or of its module, when that is not in a package). Anything else (closures,
  lambdas, partials, callable objects) is not persisted;
* the operator's results, the resolved backend, the input signature (tree
  structures, shapes, dtypes) and the device;
* typed PRNG keys: an operator taking or returning one is not persisted (a loaded
  executable does not take JAX's key arrays), nor an output spec holding one;
* the environment: the versions of Python, jax, jaxlib and numpy, the installed
  distributions, the platform and its version, the x64 and matmul-precision
  settings, ``XLA_FLAGS`` and the source of dxserve and dxcontract.

A server-side function whose result depends on anything else (a data file read
at import, a module global changed at run time, a helper outside its package)
is not tracked: clear the directory when those change.

Entries are ``MAGIC + sha256(body) + body``, written atomically (temporary file,
then rename); one whose checksum, format or key does not match, or that fails
to load, is deleted and the operator compiled again. The directory is bounded
(oldest entries by modification time go first; a hit refreshes it).

Trust: the body is a pickle (``jax.experimental.serialize_executable`` pickles
its own payload, and a loaded XLA executable is native code anyway). Every file
here is written by this server into its own cache directory, never taken from a
client, so the directory must be writable only by the server's user (it is
created with mode 0700).

Two interactions with JAX's own cache: an executable that JAX loaded from its
persistent cache cannot be re-serialized (on CPU the copy lacks its kernels and
fails at run time), so such an executable is never stored here (a thread-local
``jax.monitoring`` listener sees the hit); and each persisted program is named
after its key (``dx_<hash>``), which JAX hashes into its own key, so JAX's cache
only has an entry for a program this cache has already seen, and an upgrade of
dxserve (a new key) compiles afresh and is stored here again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from dxserve.frameworks.jax.signature import dtype_key, persistent_spec

log = logging.getLogger("dxserve.executable_cache")

MAGIC = b"DXSERVE-EXECUTABLE\x00"
FORMAT = 1
SUFFIX = ".dxexe"
OUTPUT_SUFFIX = ".dxout"
#: A package with more Python files than this is not hashed; its functions are not persisted.
MAX_PACKAGE_FILES = 2000
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclass(frozen=True)
class Key:
    text: str  # canonical JSON of every part (stored in the entry and compared on load)
    digest: str  # sha256 of ``text``: the file name
    device: Any  # the JAX device the executable runs on


class _State:
    def __init__(self) -> None:
        self.directory: Path | None = None
        self.max_bytes = 0
        self.environment: str | None = None
        self.lock = threading.Lock()
        self.tags: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.digests: dict[str, str | None] = {}  # source root or file -> sha256
        self.stats = {"loaded": 0, "stored": 0, "compiled": 0, "discarded": 0, "skipped": 0}
        self.listening = False


_state = _State()
_local = threading.local()
stats = _state.stats  # counters, for tests and logs


# --- configuration ---------------------------------------------------------
def configure(directory: str | os.PathLike | None, max_bytes: int = 1 << 30) -> None:
    """Persist executables under ``directory`` (``None`` or ``max_bytes <= 0``: off)."""
    _state.directory = None
    if directory is None or max_bytes <= 0:
        return
    path = Path(directory)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _state.listening:
            jax.monitoring.register_event_listener(_on_event)
            _state.listening = True
        _environment()  # hash the sources now, not on the first request
    except Exception as exc:  # a cache must never stop the server
        log.warning("executable cache off: %s", exc)
        return
    _state.max_bytes = max_bytes
    _state.directory = path


def enabled() -> bool:
    return _state.directory is not None


def identify(fn: Callable, kind: str, content: bytes) -> None:
    """Mark ``fn``, a function of the stored ``kind`` (``dxserve.server.kinds``), by its content."""
    tag = f"{kind}:{hashlib.sha256(content).hexdigest()}"
    try:
        with _state.lock:
            _state.tags[fn] = tag
    except TypeError:  # not weak-referenceable or not hashable: never persisted
        pass


# --- keys --------------------------------------------------------------------
def key(
    function: Callable, resolved: Any, results: tuple[str, ...], x: Any, tangents: Any,
    contexts: Any, batch_axis: int | None = None,
) -> Key | None:
    """The key of this operator executable, or None when it is not to be persisted.

    ``batch_axis``: set for an operator vmapped over points (keyed apart: the same
    shapes unbatched are another program); unbatched keys are unchanged."""
    more = {} if batch_axis is None else {"batch_axis": batch_axis}
    return _key(
        function, x, contexts,
        results=list(results),
        backend=lambda: resolved.to_json(),
        tangents=lambda: None if tangents is None else persistent_spec(tangents),
        **more,
    )


def _key(function: Callable, x: Any, contexts: Any, **more: Any) -> Key | None:
    if _state.directory is None:
        return None
    try:
        identity = _identity(function)
        if identity is None:
            return None
        device = _device()
        parts = {
            "environment": _environment(),
            "function": identity,
            "x": persistent_spec(x),
            "contexts": persistent_spec(contexts),
            "device": [device.platform, device.id, device.device_kind],
            "x64": bool(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision),
            **{k: v() if callable(v) else v for k, v in more.items()},
        }
        if _holds_keys(parts["x"]) or _holds_keys(parts["contexts"]) or _holds_keys(
            parts.get("tangents")
        ):
            return None
        text = json.dumps(parts, sort_keys=True)
    except Exception as exc:  # never fail a request over the cache
        log.debug("no executable cache key: %s", exc)
        return None
    return Key(text, hashlib.sha256(text.encode()).hexdigest(), device)


def _returns_keys(compiled: Any) -> bool:
    """Does the compiled program return a typed PRNG key?"""
    out = jax.tree_util.tree_leaves(getattr(compiled, "out_info", None))
    return any(dtype_key(v.dtype).startswith("key<") for v in out)


def _holds_keys(spec: Any) -> bool:
    """Does a ``persistent_spec`` have a typed PRNG key leaf (dtype ``key<...>``)?"""
    return bool(spec) and any(
        isinstance(leaf, list) and str(leaf[1]).startswith("key<") for leaf in spec[1:]
    )


def _device() -> Any:
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    if isinstance(device, str):
        return jax.devices(device)[0]
    return device


def _identity(fn: Callable) -> str | None:
    try:
        with _state.lock:
            tag = _state.tags.get(fn)
    except TypeError:
        tag = None
    if tag is not None:
        return tag
    if not isinstance(fn, types.FunctionType) or fn.__closure__ or "<" in fn.__qualname__:
        return None  # lambdas, closures, locals: their behaviour is not in any source file
    module = sys.modules.get(fn.__module__)
    file = getattr(module, "__file__", None)
    if not file or not file.endswith(".py"):
        return None
    top = sys.modules.get(fn.__module__.partition(".")[0])
    roots = getattr(top, "__path__", None)
    source = _digest(Path(list(roots)[0])) if roots and top is not module else _digest(Path(file))
    if source is None:
        return None
    return f"module:{fn.__module__}:{fn.__qualname__}:{source}"


def _digest(path: Path) -> str | None:
    """sha256 of a Python file, or of every ``.py`` under a package directory (cached)."""
    name = str(path)
    with _state.lock:
        if name in _state.digests:
            return _state.digests[name]
    try:
        if path.is_dir():
            files = sorted(path.rglob("*.py"))
            if len(files) > MAX_PACKAGE_FILES:
                raise ValueError(f"{len(files)} Python files")
        else:
            files = [path]
        h = hashlib.sha256()
        for file in files:
            h.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
            h.update(hashlib.sha256(file.read_bytes()).digest())
        digest: str | None = h.hexdigest()
    except (OSError, ValueError) as exc:
        log.debug("not hashing %s: %s", path, exc)
        digest = None
    with _state.lock:
        _state.digests[name] = digest
    return digest


def _environment() -> str:
    """sha256 of everything outside the key that could change the compiled program."""
    if _state.environment is not None:
        return _state.environment
    import jaxlib

    import dxcontract
    from dxserve import __file__ as dxserve_init

    device = jax.devices()[0]
    distributions = sorted(
        name
        for entry in sys.path
        if os.path.isdir(entry)
        for name in os.listdir(entry)
        if name.endswith((".dist-info", ".egg-info", ".egg-link", ".pth"))
    )
    parts = {
        "format": FORMAT,
        "python": sys.version,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "platform": [device.platform, device.client.platform_version, device.device_kind],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "distributions": distributions,
        "dxserve": _digest(Path(dxserve_init).parent),
        "dxcontract": _digest(Path(dxcontract.__file__).parent),
    }
    text = json.dumps(parts, sort_keys=True)
    _state.environment = hashlib.sha256(text.encode()).hexdigest()
    return _state.environment


# --- compile, load, store ------------------------------------------------------
def compile_or_load(key: Key | None, fn: Callable, *args: Any) -> Any:
    """``jax.jit(fn).lower(*args).compile()``, through this cache when ``key`` is given."""
    if key is None:
        return jax.jit(fn).lower(*args).compile()
    loaded = load(key)
    if loaded is not None:
        return _Loaded(loaded, key, fn, args)
    fn.__name__ = fn.__qualname__ = f"dx_{key.digest[:32]}"  # JAX's cache keys on it too
    with _watch_jax_cache() as watch:
        compiled = jax.jit(fn).lower(*args).compile()
    _state.stats["compiled"] += 1
    if watch["hits"]:
        _state.stats["skipped"] += 1  # loaded by JAX from its cache: not re-serializable
    else:
        store(key, compiled)
    return compiled


class _Loaded:
    """A stored executable that proves itself on its first call.

    XLA's executable serialization has had bugs that only show when the program runs
    (see ``_watch_jax_cache``); an entry that fails its first run is deleted and the
    program compiled afresh, instead of failing every request for that signature.
    """

    def __init__(self, executable: Any, key: Key, fn: Callable, args: tuple) -> None:
        self._executable = executable
        # shapes and dtypes only: a prepared operator not yet run keeps no request's arrays
        specs = jax.tree_util.tree_map(_spec, args)
        self._fresh: tuple[Key, Callable, tuple] | None = (key, fn, specs)

    def __call__(self, *args: Any) -> Any:
        if self._fresh is None:
            return self._executable(*args)
        key, fn, lower_args = self._fresh
        try:
            out = self._executable(*args)
        except Exception as exc:
            if "RESOURCE_EXHAUSTED" in str(exc):  # out of memory: not the entry's fault
                raise
            _bad(_path(key), exc)
            self._executable = jax.jit(fn).lower(*lower_args).compile()
            out = self._executable(*args)
        self._fresh = None
        return out

    # XLA's analyses of the loaded executable (budget.estimate reads them at preparation).
    def memory_analysis(self) -> Any:
        return self._executable.memory_analysis()

    def cost_analysis(self) -> Any:
        return self._executable.cost_analysis()

    def as_text(self) -> Any:
        return self._executable.as_text()


def _spec(value: Any) -> Any:
    return jax.ShapeDtypeStruct(
        np.shape(value), np.result_type(value), weak_type=bool(getattr(value, "weak_type", False))
    )


def _path(key: Key, suffix: str = SUFFIX) -> Path:
    assert _state.directory is not None
    return _state.directory / f"{key.digest}{suffix}"


def _read(path: Path, key: Key) -> Any | None:
    """The object stored at ``path`` for ``key``; None if absent. Raises if it is bad."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.startswith(MAGIC):
        raise ValueError("not an executable cache entry")
    digest, body = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch")
    # Written by this server into its own directory (see the module docstring).
    fmt, text, obj = pickle.loads(body)  # noqa: S301
    if fmt != FORMAT or text != key.text:
        raise ValueError("key mismatch")
    return obj


def _write(path: Path, key: Key, obj: Any) -> None:
    """Store ``obj`` at ``path`` atomically (a temporary file, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        body = pickle.dumps((FORMAT, key.text, obj), protocol=5)
        with open(tmp, "wb") as fh:
            fh.write(MAGIC + hashlib.sha256(body).digest() + body)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _bad(path: Path, exc: BaseException) -> None:
    log.warning("ignoring executable cache entry %s: %s", path.name, exc)
    _state.stats["discarded"] += 1
    _unlink(path)


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # recently used: evicted last
    except OSError:
        pass


def load(key: Key) -> Any | None:
    """The executable stored under ``key``, or None (a bad entry is deleted)."""
    if _state.directory is None:
        return None
    path = _path(key)
    try:
        found = _read(path, key)
        if found is None:
            return None
        payload, in_tree, out_tree = found
        exe = deserialize_and_load(
            payload, in_tree, out_tree, backend=key.device.client, execution_devices=[key.device]
        )
    except Exception as exc:
        _bad(path, exc)
        return None
    _touch(path)
    _state.stats["loaded"] += 1
    return exe


def store(key: Key, compiled: Any) -> bool:
    """Write ``compiled`` under ``key``; False if it cannot be serialized or written."""
    if _state.directory is None:
        return False
    path = _path(key)
    try:
        if _returns_keys(compiled):
            return False  # see the module docstring
        _write(path, key, serialize(compiled))
    except Exception as exc:  # constants or callbacks in the program, a full disk, ...
        log.info("not storing executable %s: %s", path.name, exc)
        return False
    _state.stats["stored"] += 1
    _evict(_state.directory, _state.max_bytes)
    return True


# --- output specs (what ``preparation.probe`` learns by tracing the function) ---
def output_spec(function: Callable, x: Any, contexts: tuple) -> Any | None:
    """The stored ``jax.eval_shape(function, x, *contexts)``, or None."""
    k = _key(function, x, contexts, kind="output")
    if k is None:
        return None
    path = _path(k, OUTPUT_SUFFIX)
    try:
        found = _read(path, k)
        if found is None:
            return None
        treedef, leaves = found
        y = treedef.unflatten(
            [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), weak_type=weak)
             for shape, dtype, weak in leaves]
        )
    except Exception as exc:
        _bad(path, exc)
        return None
    _touch(path)
    return y


def keep_output_spec(function: Callable, x: Any, contexts: tuple, y: Any) -> None:
    """Remember ``y = jax.eval_shape(function, x, *contexts)`` for a restart."""
    k = _key(function, x, contexts, kind="output")
    if k is None:
        return
    try:
        leaves, treedef = jax.tree_util.tree_flatten(y)
        spec = [(tuple(v.shape), dtype_key(v.dtype), bool(getattr(v, "weak_type", False)))
                for v in leaves]
        if any(dtype.startswith("key<") for _, dtype, _ in spec):
            return  # numpy cannot read a typed key's dtype back
        _write(_path(k, OUTPUT_SUFFIX), k, (treedef, spec))
    except Exception as exc:
        log.info("not storing an output spec: %s", exc)


def _evict(directory: Path, max_bytes: int) -> None:
    """Delete the least recently used entries until the directory fits ``max_bytes``
    (and temporary files that a crash left behind)."""
    try:
        entries = []
        for item in os.scandir(directory):
            if not item.is_file():
                continue
            st = item.stat()
            if item.name.endswith((SUFFIX, OUTPUT_SUFFIX)):
                entries.append((st.st_mtime_ns, st.st_size, item.path))
            elif item.name.endswith(".tmp") and st.st_mtime < time.time() - 3600:
                _unlink(Path(item.path))
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        _unlink(Path(path))
        total -= size


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


@contextmanager
def _watch_jax_cache():
    """Count JAX persistent-cache hits of this thread while inside."""
    watch = {"hits": 0}
    previous = getattr(_local, "watch", None)
    _local.watch = watch
    try:
        yield watch
    finally:
        _local.watch = previous


def _on_event(event: str, **kwargs: Any) -> None:
    if event == _JAX_CACHE_HIT:
        watch = getattr(_local, "watch", None)
        if watch is not None:
            watch["hits"] += 1
