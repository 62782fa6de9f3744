"""METIS_PartGraphKway/Recursive through ctypes, on the METIS compiled into pymetis's extension.

pymetis's Python API takes a single balance constraint; its extension module also exports the
METIS 5 C API (64-bit `idx_t`, 32-bit `real_t`), which takes several. This is the only module
that reaches it. Every call validates the graph first: METIS crashes or silently misreads
asymmetric adjacency, self loops, wrong-length arrays and non-positive weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from netpart.errors import MetisError

__all__ = ["MetisResult", "metis_available", "part_graph", "validate_csr"]

log = logging.getLogger(__name__)

_NOPTIONS = 40
_OPT_OBJTYPE, _OPT_NCUTS, _OPT_NITER, _OPT_SEED, _OPT_MINCONN, _OPT_NUMBERING = 1, 7, 6, 8, 10, 17
_OBJTYPE = {"cut": 0, "vol": 1}
_STATUS = {1: "ok", -2: "erroneous input or options", -3: "out of memory", -4: "error"}
_IDX = np.int64
_REAL = np.float32


def _load() -> tuple[ctypes.CDLL | None, str]:
    try:
        import pymetis._internal as ext
    except ImportError as exc:  # pragma: no cover - depends on the installation
        return None, f"pymetis is not importable ({exc}); install it with `pip install pymetis`"
    try:
        lib = ctypes.CDLL(ext.__file__)
        fns = [lib.METIS_PartGraphKway, lib.METIS_PartGraphRecursive]
        lib.METIS_SetDefaultOptions  # noqa: B018 - probe the symbol
    except (OSError, AttributeError) as exc:  # pragma: no cover
        return None, (
            f"pymetis's extension {ext.__file__} does not export the METIS C API ({exc}); "
            "multi-constraint partitioning needs it (pymetis >= 2023.1)"
        )
    for fn in fns:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 13
    return lib, ""


_LIB, _WHY = _load()


def metis_available() -> tuple[bool, str]:
    """(True, "") when METIS_PartGraphKway/Recursive can be called, else (False, why)."""
    return _LIB is not None, _WHY


@dataclass(frozen=True)
class MetisResult:
    parts: np.ndarray  # int64 [V]
    objval: int  # edge cut or communication volume, as METIS counts it


def validate_csr(
    xadj: np.ndarray,
    adjncy: np.ndarray,
    vwgt: np.ndarray,
    vsize: np.ndarray | None,
    adjwgt: np.ndarray | None,
    *,
    symmetric: bool = False,
) -> None:
    """Raise MetisError unless the arrays form a graph METIS reads correctly (`symmetric`:
    the adjacency is known symmetric with equal weights both ways; not checked again)."""
    n = len(xadj) - 1
    if n < 1:
        raise MetisError("METIS input: the graph has no vertices")
    if xadj[0] != 0 or np.any(np.diff(xadj) < 0) or xadj[-1] != len(adjncy):
        raise MetisError("METIS input: xadj must start at 0, not decrease, and end at len(adjncy)")
    if vwgt.ndim != 2 or vwgt.shape[0] != n:
        raise MetisError(f"METIS input: vertex weights must be [{n}, ncon], got {vwgt.shape}")
    if np.any(vwgt < 0) or np.any(vwgt.sum(axis=1) <= 0):
        raise MetisError("METIS input: every vertex needs a positive weight in some constraint")
    if np.any(vwgt.sum(axis=0) <= 0):
        raise MetisError("METIS input: every balance constraint needs a positive total weight")
    if vsize is not None and (len(vsize) != n or np.any(vsize <= 0)):
        raise MetisError(f"METIS input: vertex sizes must be {n} positive integers")
    if adjwgt is not None and (len(adjwgt) != len(adjncy) or np.any(adjwgt <= 0)):
        raise MetisError("METIS input: edge weights must be positive, one per adjacency entry")
    if len(adjncy) == 0:
        return
    if adjncy.min() < 0 or adjncy.max() >= n:
        raise MetisError("METIS input: adjacency refers to a vertex outside 0..n-1")
    src = np.repeat(np.arange(n, dtype=np.int32 if n < 2**31 else np.int64), np.diff(xadj))
    if np.any(src == adjncy):
        raise MetisError("METIS input: the graph has self loops")
    if symmetric:
        return
    src = src.astype(np.int64)
    fwd = src * n + adjncy
    rev = adjncy * n + src
    weights = np.ones(1, dtype=np.int64) if adjwgt is None else np.asarray(adjwgt)
    span = int(weights.max()) + 1
    if np.all(fwd[1:] > fwd[:-1]) and n * n * span < 2**62:
        # Rows ascending (no duplicate): symmetric with equal weights iff the reversed
        # entries, weight included, sort into the forward ones (one sort, no argsort).
        if adjwgt is not None:
            fwd, rev = fwd * span + weights, rev * span + weights
        rev.sort()
        if not np.array_equal(fwd, rev):
            raise MetisError(
                "METIS input: adjacency is not symmetric (u->v without v->u), or edge weights "
                "differ between u->v and v->u"
            )
        return
    order_f, order_r = np.argsort(fwd, kind="stable"), np.argsort(rev, kind="stable")
    if not np.array_equal(fwd[order_f], rev[order_r]):
        raise MetisError("METIS input: adjacency is not symmetric (u->v without v->u)")
    if np.any(np.diff(fwd[order_f]) == 0):
        raise MetisError("METIS input: the graph has duplicate edges")
    if adjwgt is not None and not np.array_equal(adjwgt[order_f], adjwgt[order_r]):
        raise MetisError("METIS input: edge weights differ between u->v and v->u")


def part_graph(
    xadj: np.ndarray,
    adjncy: np.ndarray,
    vwgt: np.ndarray,
    nparts: int,
    *,
    vsize: np.ndarray | None = None,
    adjwgt: np.ndarray | None = None,
    tpwgts: np.ndarray | None = None,
    ubvec: np.ndarray | None = None,
    algorithm: str = "kway",
    objective: str = "vol",
    seed: int = 0,
    ncuts: int = 1,
    niter: int = 10,
    minconn: bool = False,
    symmetric: bool = False,
) -> MetisResult:
    """Partition into `nparts` with `vwgt.shape[1]` balance constraints; validates the graph first.

    `algorithm` is "kway" (METIS_PartGraphKway; objective "vol" or "cut") or "recursive"
    (METIS_PartGraphRecursive, recursive bisection; objective "cut" only). `tpwgts`
    [nparts, ncon] are target fractions per part (columns sum to 1); `ubvec` [ncon] the allowed
    imbalance per constraint (1.05 = 5%). `symmetric`: the caller built the adjacency
    symmetric, weights included, by construction (a `UnitGraph`'s, tested so): the one check
    that sorts every entry is skipped; every other check runs.
    """
    if _LIB is None:
        raise MetisError(_WHY)
    xadj = np.ascontiguousarray(xadj, dtype=_IDX)
    adjncy = np.ascontiguousarray(adjncy, dtype=_IDX)
    vwgt = np.ascontiguousarray(vwgt, dtype=_IDX)
    if vwgt.ndim == 1:
        vwgt = vwgt[:, None]
    validate_csr(xadj, adjncy, vwgt, vsize, adjwgt, symmetric=symmetric)
    n, ncon = vwgt.shape
    if nparts < 1:
        raise MetisError(f"METIS input: nparts must be >= 1, got {nparts}")
    if nparts == 1:
        return MetisResult(np.zeros(n, dtype=np.int64), 0)
    opts = _options(algorithm, objective, seed=seed, ncuts=ncuts, niter=niter, minconn=minconn)
    tp, ub = _arr(tpwgts, _REAL), _arr(ubvec, _REAL)
    if tp is not None and tp.size != nparts * ncon:
        raise MetisError(f"METIS input: tpwgts must have {nparts}x{ncon} entries, got {tp.size}")
    if ub is not None and (ub.size != ncon or np.any(ub <= 1.0)):
        raise MetisError(f"METIS input: ubvec must be {ncon} values > 1")
    nvtxs, ncon_a, nparts_a = (np.array([x], dtype=_IDX) for x in (n, ncon, nparts))
    objval = np.zeros(1, dtype=_IDX)
    part = np.zeros(n, dtype=_IDX)
    fn = _LIB.METIS_PartGraphKway if algorithm == "kway" else _LIB.METIS_PartGraphRecursive
    graph = (nvtxs, ncon_a, xadj, adjncy, vwgt.ravel(), _arr(vsize, _IDX), _arr(adjwgt, _IDX))
    arrays = (*graph, nparts_a, tp, ub, opts, objval, part)
    with _quiet():
        status = fn(*(None if a is None else a.ctypes.data_as(ctypes.c_void_p) for a in arrays))
    if status != 1:
        raise MetisError(f"METIS ({algorithm}) failed: {_STATUS.get(status, status)}")
    if part.min() < 0 or part.max() >= nparts:
        raise MetisError("METIS returned part ids outside 0..nparts-1")
    log.debug("METIS %s %d parts, %d constraints: objval %d", algorithm, nparts, ncon, objval[0])
    return MetisResult(part.astype(np.int64), int(objval[0]))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """METIS prints to the C stdout ("***Cannot bisect a graph with 0 vertices!", its
    timers): while it runs, file descriptors 1 and 2 point at a temporary file, whose text
    goes to the debug log afterwards."""
    libc = ctypes.CDLL(None)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            libc.fflush(None)  # what METIS left in C's buffers goes to the file, not the user
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        sink.seek(0)
        text = sink.read().decode(errors="replace").strip()
    if text:
        log.debug("METIS said: %s", text)


def _arr(a: np.ndarray | None, dtype: type) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a, dtype=dtype).ravel()


def _options(
    algorithm: str, objective: str, *, seed: int, ncuts: int, niter: int, minconn: bool
) -> np.ndarray:
    """METIS's options array for one call (its defaults, then ours)."""
    if objective not in _OBJTYPE:
        raise MetisError(f"METIS objective must be one of {sorted(_OBJTYPE)}, got {objective!r}")
    if algorithm not in ("kway", "recursive"):
        raise MetisError(f"METIS algorithm must be 'kway' or 'recursive', got {algorithm!r}")
    if algorithm == "recursive" and objective != "cut":
        raise MetisError("METIS recursive bisection minimises the edge cut only; use objective cut")
    opts = np.full(_NOPTIONS, -1, dtype=_IDX)
    _LIB.METIS_SetDefaultOptions(opts.ctypes.data_as(ctypes.c_void_p))
    if algorithm == "kway":
        opts[_OPT_OBJTYPE] = _OBJTYPE[objective]
        opts[_OPT_MINCONN] = int(minconn)
    opts[_OPT_SEED] = seed
    opts[_OPT_NCUTS] = ncuts
    opts[_OPT_NITER] = niter
    opts[_OPT_NUMBERING] = 0
    return opts
