"""Pydantic models that document the API in OpenAPI (bodies are parsed by ``wire``)."""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from dxcontract.operators import AUX, OPERATORS, OperatorSpec
from dxserve.core.holomorphic import FAMILIES as HOLOMORPHIC_FAMILIES
from dxserve.server.kinds import names as kind_names
from dxserve.server.kinds import register_model


class TypedArray(BaseModel):
    """An array with its dtype: base64 of little-endian C-order bytes (or a nested
    list in lists mode, or a buffer reference in the binary framing). A typed PRNG key
    array (a context) has dtype ``key<threefry2x32>`` (or ``key<rbg>``, ``key<unsafe_rbg>``),
    its own shape (``[]`` for one key) and its uint32 words as data
    (``jax.random.key_data``: shape + ``[2]``, or ``[4]`` for the rbg ones)."""

    model_config = ConfigDict(
        populate_by_name=True,
        json_schema_extra={
            "example": {"__ndarray__": "AAAAAAAA8D8AAAAAAAAAQA==", "dtype": "float64", "shape": [2]}
        },
    )
    ndarray: str | list[Any] | dict[str, int] = Field(alias="__ndarray__")
    dtype: str = Field(examples=["float64", "float32", "int64", "key<threefry2x32>"])
    shape: list[int]


#: JSON has no NaN or infinities: a scalar one travels as one of these strings
NonFinite = Literal["NaN", "Infinity", "-Infinity"]
Array = float | NonFinite | list[Any] | TypedArray | dict[str, Any]
ARRAY_DOC = (
    "A number, a nested list (float64), a typed array object, or a pytree "
    "(JSON object of arrays). NaN and infinities are the strings "
    "\"NaN\", \"Infinity\", \"-Infinity\"."
)


# --- backend descriptors (what ``dxcontract.backends.backend_from_json`` takes) ----------
_BATCH = Field(None, ge=1, description="Tangents per vectorized call; null: all at once")


class JaxForwardBackend(BaseModel):
    """Forward mode: JVPs; Jacobians from ``batch_size`` columns per call."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"example": {"type": "jax-forward", "batch_size": 16}})
    type: Literal["jax-forward"]
    batch_size: int | None = _BATCH


class JaxReverseBackend(BaseModel):
    """Reverse mode: VJPs; Jacobians from ``batch_size`` rows per call."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["jax-reverse"]
    batch_size: int | None = _BATCH


class TorchForwardBackend(BaseModel):
    """PyTorch forward mode (``torch.func.jvp``), for functions written in torch."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["torch-forward"]
    batch_size: int | None = _BATCH


class TorchReverseBackend(BaseModel):
    """PyTorch reverse mode (``torch.func.vjp``), for functions written in torch."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["torch-reverse"]
    batch_size: int | None = _BATCH


class FiniteDifferencesBackend(BaseModel):
    """Finite differences (any function, traced or not)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["finite-differences"]
    method: Literal["central", "forward"] | None = "central"
    step: float | None = Field(None, gt=0, description="null: chosen from the dtype")
    batch_size: int | None = _BATCH


FirstOrderName = Literal[
    "jax-forward", "jax-reverse", "torch-forward", "torch-reverse", "finite-differences"
]
FirstOrderBackend = Annotated[
    JaxForwardBackend | JaxReverseBackend | TorchForwardBackend | TorchReverseBackend
    | FiniteDifferencesBackend,
    Field(discriminator="type"),
]


class SecondOrderBackend(BaseModel):
    """HVPs and Hessians: ``outer`` differentiates ``inner``'s gradient (first-order each)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"example": {
        "type": "second-order", "outer": {"type": "jax-forward"}, "inner": {"type": "jax-reverse"}}})
    type: Literal["second-order"]
    outer: FirstOrderName | FirstOrderBackend
    inner: FirstOrderName | FirstOrderBackend


class AutoBackend(BaseModel):
    """Picked per operator and shape."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["auto"]


class SparsityPattern(BaseModel):
    """A pattern without values: CSR (``indptr`` + column ``indices``) or COO (``[i, j]`` pairs)."""

    format: Literal["csr", "coo"]
    shape: list[int] = Field(min_length=2, max_length=2)
    indptr: list[int] | None = Field(None, description="csr: m + 1 row offsets")
    indices: list[int] | list[list[int]] = Field(description="csr: columns; coo: [row, col] pairs")


class SparseBackend(BaseModel):
    """Sparse Jacobians and Hessians: one pass of ``dense`` per colour of the pattern."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"example": {
        "type": "sparse", "dense": "jax-forward", "coloring": "column"}})
    type: Literal["sparse"]
    dense: (
        Literal["auto", "jax-forward", "jax-reverse", "finite-differences"]
        | Annotated[
            JaxForwardBackend | JaxReverseBackend | FiniteDifferencesBackend | SecondOrderBackend
            | AutoBackend,
            Field(discriminator="type"),
        ]
    ) = "auto"
    sparsity: SparsityPattern | None = Field(None, description="null: detected from the function")
    coloring: Literal["column", "row", "star"] | None = None
    format: Literal["csr", "coo"] | None = "csr"


BackendObject = Annotated[
    JaxForwardBackend | JaxReverseBackend | TorchForwardBackend | TorchReverseBackend
    | FiniteDifferencesBackend | SecondOrderBackend | AutoBackend | SparseBackend,
    Field(discriminator="type"),
]
#: the shorthands: a backend named by its type, with default parameters
BackendName = Literal[
    "auto", "jax-forward", "jax-reverse", "torch-forward", "torch-reverse",
    "finite-differences", "sparse",
]


_SHAPED_LIKE = {"x": "x", "y": "f(x)"}


def request_model(op: OperatorSpec) -> type[BaseModel]:
    fields: dict[str, Any] = {
        "function": (str, Field(description="Name of a registered function", examples=["rosenbrock"])),
        "backend": (
            BackendName | BackendObject,
            Field("auto", description="A backend's name (its defaults) or its descriptor object",
                  examples=["jax-reverse"]),
        ),
        "x": (Array, Field(description="The active input. " + ARRAY_DOC, examples=[[1.0, 2.0, 3.0]])),
        "contexts": (
            list[Array],
            Field(
                default_factory=list,
                description="Extra inputs, not differentiated; typed PRNG keys travel here "
                '(dtype "key<threefry2x32>", see TypedArray), never as x',
            ),
        ),
        "prep": (str | None, Field(None, description="Handle from POST /prepare/{operator}")),
        "batch_axis": (
            Literal[0] | None,
            Field(
                None,
                description="0: x (every leaf) and each tangent lead with an axis of B "
                "independent points, contexts shared; results come back stacked (B, ...), "
                "computed in one vmapped call. null: one point",
                examples=[0],
            ),
        ),
    }
    fields["wrt"] = (
        int | list[int] | None,
        Field(
            None,
            description="The arguments differentiated, numbered as JAX's argnums: 0 is x, "
            "k is contexts[k-1]. null: x. One number k: argument k alone (results and "
            "tangents shaped like it). A list: those arguments together, results and "
            "tangents as `__tuple__`s with one entry per argument, in the list's order; "
            "batch_axis then applies to them, the others shared. Integer and key "
            "arguments cannot be named (422 naming `wrt`)",
            examples=[[0, 1]],
        ),
    )
    if op.family == "hvp":
        fields["cotangent"] = (
            Array | None,
            Field(
                None,
                description="For an array-valued function: the HVPs (and gradient) of "
                "<cotangent, f>, shaped like f(x): the derivative in x of f's pullback of "
                "the cotangent (a JVP of the VJP), second order of array-valued functions. "
                "null: f itself, scalar-valued",
            ),
        )
    if op.aux:
        fields["has_aux"] = (
            bool,
            Field(
                False,
                description="true: the function returns a pair (output, aux); output is "
                "differentiated and aux, evaluated at x and never differentiated, comes back "
                "as the answer's `aux` (stacked (B, ...) with batch_axis=0). The function "
                "must return a 2-tuple then (422 otherwise)",
                examples=[True],
            ),
        )
    if op.family in HOLOMORPHIC_FAMILIES:
        fields["holomorphic"] = (
            bool,
            Field(
                False,
                description="true: the function is holomorphic, and its Jacobian of complex x "
                "is f'(z) (JAX's holomorphic=True); every leaf of x and of f(x) must then be "
                "complex. A Jacobian of complex x is refused without it (422 naming "
                "holomorphic), as jax.jacfwd and jax.hessian refuse it: only a holomorphic "
                "function's pushforward is a complex matrix. Real x needs no declaration",
                examples=[True],
            ),
        )
    if op.tangents_like is not None:
        like = _SHAPED_LIKE[op.tangents_like]
        fields["tangents"] = (
            list[Array],
            Field(description=f"A batch of tangents, each shaped like {like}", min_length=1),
        )
    model = create_model(
        f"{_camel(op.name)}Request",
        __config__=ConfigDict(json_schema_extra={"example": copy.deepcopy(dict(op.example))}),
        **fields,
    )
    return model


def response_model(op: OperatorSpec) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for name in op.results:
        if name in op.batch_results:
            fields[name] = (list[Array], Field(description="One result per tangent"))
        else:
            fields[name] = (Array, Field(description=ARRAY_DOC))
    if op.aux:
        fields[AUX] = (
            Array | list[Any] | None,
            Field(
                None,
                description="With has_aux only: the function's aux at x, a pytree of arrays "
                "encoded like the other results (tuples and lists as `__tuple__`/`__list__` "
                "objects). " + ARRAY_DOC,
            ),
        )
    return create_model(f"{_camel(op.name)}Response", **fields)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


REQUESTS = {name: request_model(op) for name, op in OPERATORS.items()}
RESPONSES = {name: response_model(op) for name, op in OPERATORS.items()}


class Problem(BaseModel):
    """RFC 9457 problem details (``application/problem+json``)."""

    type: str = Field(examples=["urn:dxserve:problem:shape-mismatch"])
    title: str
    status: int
    detail: str
    field: str | None = Field(None, description="The request field that was wrong")


def __getattr__(name: str) -> Any:
    # RegisterFunction (the POST /functions body) has the fields of every kind added
    # to dxserve.server.kinds, so it is built from them when used rather than at import.
    if name == "RegisterFunction":
        return register_model()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kind_names(schema: dict[str, Any]) -> None:
    # Read when the schema is generated, so kinds added later are listed too.
    schema["enum"] = kind_names()


_SHAPE = Field(
    None, description="Dimensions where known: integers, or strings for an export's "
    "symbolic dimensions (any size, the same wherever the name recurs); null: unknown "
    "(or a pytree: see `tree`)", examples=[[3]],
)


class ArgumentInfo(BaseModel):
    """One argument of ``f(x, *contexts)``."""

    name: str = Field(examples=["x"])
    role: Literal["x", "context"] = Field(description="`x` is differentiated, contexts are not")
    shape: list[int | str] | None = _SHAPE
    dtype: str | None = Field(None, examples=["float64"])
    tree: dict[str, Any] | None = Field(
        None, description="A pytree argument: `{\"dict\": {key: node}}`, `{\"list\": [...]}`, "
        "`{\"tuple\": [...]}` down to leaves `{\"shape\", \"dtype\"}`",
    )


class OutputInfo(BaseModel):
    shape: list[int | str] | None = _SHAPE
    dtype: str | None = None
    tree: dict[str, Any] | None = None


class ExampleRequest(BaseModel):
    """A request this function answers: POST ``body`` to ``path`` as it is."""

    path: str = Field(examples=["/gradient"])
    body: dict[str, Any]


class FunctionInfoModel(BaseModel):
    name: str
    kind: str = Field(json_schema_extra=_kind_names)
    description: str
    signature: dict[str, Any] = Field(
        description="The kind's own: parameter names (`args`), an expression's text, an "
        "export's manifest (versions, platforms, signature, artifact hashes)"
    )
    digest: str | None = None
    created: str | None = None
    arguments: list[ArgumentInfo] = Field(
        default_factory=list, description="x, then the contexts, with shapes and dtypes where known"
    )
    output: OutputInfo | None = Field(None, description="f(x, *contexts)'s shape and dtype, where known")
    shapes_from: Literal["export", "example", "annotations", "probe"] | None = Field(
        None, description="Where the shapes come from: an export's signature (required "
        "shapes), a registered example or annotations (shapes it was checked on), an "
        "expression evaluated on small arrays at registration; null: unknown",
    )
    operators: list[str] = Field(
        default_factory=list, description="The operators these shapes allow (all when unknown)"
    )
    example: ExampleRequest | None = Field(None, description="A request to try, where shapes are known")


class FunctionSummary(BaseModel):
    name: str
    kind: str = Field(json_schema_extra=_kind_names)
    description: str
    href: str = Field(description="Its full description: `GET /functions/{name}`")


class FunctionList(BaseModel):
    functions: list[FunctionSummary | FunctionInfoModel] = Field(
        description="By name; with `?details=true`, each function's full description "
        "(what `GET /functions/{name}` answers) instead"
    )


class PrepareResponse(BaseModel):
    prep: str = Field(description="Pass as `prep` in later requests")
    operator: str
    function: str
    backend: dict[str, Any] = Field(description="The backend as requested")
    resolved: dict[str, Any] = Field(description="The concrete backend it runs with")
    reason: str | None = Field(
        None,
        description="`auto` only: why `resolved` was chosen, Auto's rule or the modes that "
        "do not trace for this function and the one used instead",
    )
    sparsity: dict[str, Any] | None = Field(
        None,
        description="Sparse backends only: what preparation found (`of`: jacobian or "
        "hessian, `shape`, `nnz`, `colors`, `coloring`: column/row/star, `mode`, `source`: "
        "detected/given, `seconds`)",
    )


# --- detached jobs ------------------------------------------------------------------------
class JobProgress(BaseModel):
    done: int = Field(description="Chunks' worth of `unit` computed so far")
    total: int | None = Field(None, description="All of them; null until a chunked run starts")
    unit: Literal["columns", "rows", "points", "tangents"] | None = None


class JobTimings(BaseModel):
    queued_seconds: float = Field(description="From submission to the first run's start")
    running_seconds: float | None = Field(None, description="From the first start to the end (or now)")


class JobChunks(BaseModel):
    computed: int = Field(description="Chunks computed and checkpointed, over every run")
    restored: int = Field(description="Chunks a resumed run took back from checkpoints")


class JobStatus(BaseModel):
    """A detached job (`POST /jobs/{operator}`), as its owner sees it."""

    id: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    operator: str = Field(examples=["hessian"])
    function: str
    has_aux: bool = Field(False, description="Submitted with `has_aux`: the result has `aux`")
    progress: JobProgress
    created: str = Field(description="ISO 8601, UTC")
    started: str | None = None
    finished: str | None = None
    timings: JobTimings
    attempts: int = Field(description="Runs started (a run resumed after a crash counts again)")
    chunks: JobChunks
    cancel_requested: bool
    result_bytes: int = Field(description="Bytes of the stored result (binary encoding)")
    expires: str | None = Field(None, description="When an ended job is removed (DXSERVE_JOB_RESULT_TTL)")
    runner: str | None = Field(None, description="The process running it: host:pid:tag")
    error: Problem | None = Field(None, description="A failed job's problem document")


class JobList(BaseModel):
    jobs: list[JobStatus] = Field(description="The caller's jobs, newest first")
    next: str | None = Field(None, description="Pass as `after` for the next page; null: no more")
