# SPDX-License-Identifier: MIT
"""Batch bookkeeping of kvtier.hf on top of the sequence lifecycle calls, without torch.

A transformers cache is a batch of rows; kvtier.hf keeps one kvtier Sequence per row, in batch
order. Reordering, repeating or selecting rows (beam search, num_return_sequences, batch
selection) becomes: each distinct source row keeps its Sequence for its first new row and is
forked (kvt_seq_fork) for every further one; rows no longer referenced are closed. Cropping
(assisted decoding's rollback) truncates every row (kvt_seq_truncate)."""

from __future__ import annotations

import operator
from typing import Any, List, NamedTuple, Optional, Tuple

from .cache import Cache, Sequence


class RowPlan(NamedTuple):
    """How a new batch is made from the old one.
    sources: old row of each new row; forks: new rows that get a fork of their source (the
    first new row of each source takes the old Sequence itself); close: old rows no new row
    takes, in ascending order."""
    sources: List[int]
    forks: List[int]
    close: List[int]

    @property
    def identity(self) -> bool:
        return not self.forks and not self.close and self.sources == sorted(self.sources)


def as_rows(indices: Any, n_old: int, what: str = "indices") -> List[int]:
    """Old row numbers from an int, a sequence of ints, or a 1-D integer or boolean tensor or
    array (a boolean one selects its true positions, as tensor indexing does). Negative numbers
    count from the end, as in Python and torch indexing; anything outside [-n_old, n_old) is an
    IndexError."""
    dtype = str(getattr(indices, "dtype", ""))
    if hasattr(indices, "tolist"):
        shape = tuple(getattr(indices, "shape", ()))
        if len(shape) > 1:
            raise ValueError("%s: a %d-D index %s, want 1-D" % (what, len(shape), shape))
        indices = indices.tolist()
    if isinstance(indices, bool) or not isinstance(indices, (list, tuple, range)):
        indices = [indices]
    if dtype in ("torch.bool", "bool") or (indices and all(isinstance(i, bool)
                                                             for i in indices)):
        if len(indices) != n_old:
            raise IndexError("%s: a boolean mask of %d entries for a batch of %d rows"
                             % (what, len(indices), n_old))
        return [i for i, keep in enumerate(indices) if keep]
    rows = []
    for i in indices:
        j = operator.index(i)
        if not -n_old <= j < n_old:
            raise IndexError("%s: row %d of a batch of %d rows" % (what, j, n_old))
        rows.append(j + n_old if j < 0 else j)
    return rows


def repeat_rows(n_old: int, repeats: Any) -> List[int]:
    """The rows of batch_repeat_interleave(repeats): each old row `repeats` times in place."""
    r = operator.index(repeats)
    if r < 1:
        raise ValueError("repeats = %d, want >= 1" % r)
    return [i for i in range(n_old) for _ in range(r)]


def plan(rows: List[int], n_old: int) -> RowPlan:
    """The RowPlan making new row i from old row rows[i] (rows already checked by as_rows)."""
    if not rows:
        raise ValueError("an empty batch: every row would be dropped")
    taken = set()
    forks = []
    for i, j in enumerate(rows):
        if not 0 <= j < n_old:
            raise IndexError("row %d of a batch of %d rows" % (j, n_old))
        if j in taken:
            forks.append(i)
        taken.add(j)
    return RowPlan(list(rows), forks, [j for j in range(n_old) if j not in taken])


def fork_rows(cache: Cache, seqs: List[Sequence],
              p: RowPlan) -> Tuple[List[Sequence], List[Sequence]]:
    """Apply the forks of `p`: returns (the new batch's Sequences, the old Sequences to close).
    All or nothing: when a fork fails, the forks made are closed and the error (kvtier.Error)
    raised, with `seqs` and the cache as they were."""
    new: List[Optional[Sequence]] = [None] * len(p.sources)
    fork_at = set(p.forks)
    made: List[Sequence] = []
    try:
        for i, j in enumerate(p.sources):
            if i in fork_at:
                s = cache.fork(seqs[j])
                made.append(s)
                new[i] = s
            else:
                new[i] = seqs[j]
    except BaseException:
        for s in reversed(made):
            try:
                s.close()
            except Exception:  # pragma: no cover - closing a sequence just opened
                pass
        raise
    return new, [seqs[j] for j in p.close]  # type: ignore[return-value]


def close_all(seqs: List[Sequence]) -> None:
    """Close every Sequence of `seqs`; the first error is raised once all were tried."""
    first: Optional[BaseException] = None
    for s in seqs:
        try:
            s.close()
        except Exception as e:  # pragma: no cover - a sequence this package opened
            first = first or e
    if first is not None:
        raise first


def crop_target(current: int, max_length: Any) -> Optional[int]:
    """transformers' crop(max_length): the length to keep (a negative max_length removes that
    many tokens; the result is at least 0), or None when nothing is dropped."""
    m = operator.index(max_length)
    if m < 0:
        m = max(current - abs(m), 0)
    return None if current <= m else m


def truncate_rows(cache: Cache, seqs: List[Sequence], n_tokens: int) -> int:
    """Drop the last n_tokens of every Sequence of `seqs` (kvt_seq_truncate: every layer).
    Returns how many were truncated before an error, which is re-raised with the attribute
    `rows_done` (0: nothing changed, kvt_seq_truncate being all or nothing)."""
    done = 0
    try:
        for s in seqs:
            cache.truncate(s, n_tokens)
            done += 1
    except BaseException as e:
        try:
            e.rows_done = done  # type: ignore[attr-defined]
        except Exception:  # pragma: no cover
            pass
        raise
    return done
