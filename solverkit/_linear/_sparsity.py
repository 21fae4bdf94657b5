"""Sparsity patterns, analysed once on the host with numpy: column colouring (for
compressed Jacobians), reverse Cuthill–McKee ordering (for a small bandwidth) and
connected components (for block-diagonal systems).

A pattern is kept as the sorted, unique coordinates `(rows, cols)` of its nonzeros,
so that patterns of 10⁵ unknowns never need an `(n, n)` array.

??? cite "References"

    A. R. Curtis, M. J. D. Powell, J. K. Reid, *On the estimation of sparse Jacobian
    matrices*, IMA J. Appl. Math. 13 (1974) 117–119 (columns with no row in common
    share one difference, here one Jacobian-vector product).

    A. H. Gebremedhin, F. Manne, A. Pothen, *What color is your Jacobian? Graph
    coloring for computing derivatives*, SIAM Review 47 (2005) 629–705 (colouring
    the columns is distance-2 colouring of the bipartite graph of the pattern).

    E. Cuthill, J. McKee, *Reducing the bandwidth of sparse symmetric matrices*,
    Proc. 24th ACM National Conference (1969) 157–172; A. George, *Computer
    implementation of the finite element method*, Stanford report STAN-CS-71-208
    (1971) (the reversal).
"""

import collections
import heapq

import numpy as np


def coordinates(pattern) -> tuple[int, np.ndarray, np.ndarray]:
    """`(n, rows, cols)` of a square pattern given as a boolean array-like `(n, n)`
    or a scipy.sparse matrix/array (any explicitly stored entry counts, even a zero),
    with the diagonal added (an iteration matrix `M - γh J` always has it)."""
    if hasattr(pattern, "tocoo"):  # scipy.sparse, without importing scipy
        coo = pattern.tocoo()
        shape = coo.shape
        rows, cols = np.asarray(coo.row), np.asarray(coo.col)
    else:
        array = np.asarray(pattern)
        if array.dtype != np.bool_:
            raise ValueError(
                "SparseLinearSolver: `pattern` must be a boolean (n, n) array or a "
                f"scipy.sparse matrix; got dtype {array.dtype}"
            )
        shape = array.shape
        rows, cols = np.nonzero(array) if array.ndim == 2 else (None, None)
    if len(shape) != 2 or shape[0] != shape[1] or shape[0] == 0:
        raise ValueError(
            "SparseLinearSolver: `pattern` must be square, (n, n) with n >= 1; got "
            f"shape {shape}"
        )
    n = int(shape[0])
    assert rows is not None and cols is not None
    diagonal = np.arange(n)
    key = np.unique(
        np.concatenate([rows, diagonal]).astype(np.int64) * n
        + np.concatenate([cols, diagonal])
    )
    return n, (key // n).astype(np.int32), (key % n).astype(np.int32)


def _lists(n: int, keys: np.ndarray, values: np.ndarray) -> list[np.ndarray]:
    """`values` grouped by `keys` (both sorted by `keys` first)."""
    order = np.argsort(keys, kind="stable")
    splits = np.searchsorted(keys[order], np.arange(1, n))
    return np.split(values[order], splits)


def colour_columns(n: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Colours of the columns such that no row has two nonzeros of one colour: the
    DSatur heuristic (D. Brélaz, *New methods to color the vertices of a graph*,
    Comm. ACM 22 (1979) 251–256) on the graph joining columns that share a row, or
    greedy colouring in natural order where that needs fewer colours (as for banded
    patterns). Tridiagonal: 3 colours; a 2-D 5-point stencil: 5.

    **Returns:**

    The colour of each column, `(n,)` int32, colours `0 ... k-1`.
    """
    by_row = _lists(n, rows, cols)
    by_col = _lists(n, cols, rows)
    neighbours = [
        np.setdiff1d(np.concatenate([by_row[r] for r in by_col[c]]), [c])
        for c in range(n)
    ]

    natural = np.full(n, -1, np.int32)
    for c in range(n):
        natural[c] = _smallest_missing({int(k) for k in natural[neighbours[c]]})

    colour = np.full(n, -1, np.int32)
    saturation: list[set[int]] = [set() for _ in range(n)]
    heap = [(0, -len(neighbours[c]), c) for c in range(n)]
    heapq.heapify(heap)
    while heap:
        minus_sat, _, c = heapq.heappop(heap)
        if colour[c] >= 0 or -minus_sat != len(saturation[c]):
            continue  # coloured, or a stale entry
        k = _smallest_missing(saturation[c])
        colour[c] = k
        for j in neighbours[c]:
            if colour[j] < 0 and k not in saturation[j]:
                saturation[j].add(k)
                heapq.heappush(heap, (-len(saturation[j]), -len(neighbours[j]), j))
    return colour if colour.max() <= natural.max() else natural


def _smallest_missing(taken: set[int]) -> int:
    k = 0
    while k in taken:
        k += 1
    return k


def _symmetric_neighbours(n: int, rows: np.ndarray, cols: np.ndarray):
    key = np.unique(
        np.concatenate([rows, cols]).astype(np.int64) * n + np.concatenate([cols, rows])
    )
    return _lists(n, key // n, (key % n).astype(np.int64))


def components(n: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The connected component of each unknown in the symmetrised pattern, `(n,)`,
    numbered `0 ... m-1` in order of their smallest unknown."""
    neighbours = _symmetric_neighbours(n, rows, cols)
    label = np.full(n, -1, np.int64)
    count = 0
    for start in range(n):
        if label[start] >= 0:
            continue
        label[start] = count
        stack = [start]
        while stack:
            for j in neighbours[stack.pop()]:
                if label[j] < 0:
                    label[j] = count
                    stack.append(int(j))
        count += 1
    return label


def reverse_cuthill_mckee(n: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """A permutation `perm` (new position -> unknown) with a small bandwidth: a
    breadth-first search from a least-connected unknown of each component, visiting
    neighbours by increasing degree, reversed."""
    neighbours = _symmetric_neighbours(n, rows, cols)
    degree = np.array([len(a) for a in neighbours])
    seen = np.zeros(n, bool)
    order: list[int] = []
    for start in np.argsort(degree, kind="stable"):
        if seen[start]:
            continue
        seen[start] = True
        queue = collections.deque([int(start)])
        while queue:
            i = queue.popleft()
            order.append(i)
            new = [int(j) for j in neighbours[i] if not seen[j]]
            new.sort(key=lambda j: degree[j])
            for j in new:
                seen[j] = True
                queue.append(j)
    return np.asarray(order[::-1], np.int32)


def bandwidths(rows: np.ndarray, cols: np.ndarray, position: np.ndarray):
    """`(lower, upper)` of the pattern with unknown `i` moved to `position[i]`."""
    offset = position[cols].astype(np.int64) - position[rows]
    return int(max(0, -offset.min())), int(max(0, offset.max()))
