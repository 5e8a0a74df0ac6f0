"""A training run's row sequence: which row each position of the run reads.

A run reads ``train.steps × batch_size × workers`` rows: every row once per epoch, epoch after epoch, in file order
(``train.shuffle_seed`` null) or in a permutation drawn from ``(seed, epoch)`` alone, so the rows of any step are known
without replaying the epochs before it and a resumed run skips exactly the rows it trained on.

:class:`RowsByPosition` travels inside the training dataset: Ray Train's controller, its dataset manager and Ray
Data's read tasks unpickle it, and so import this module. It imports numpy and pyarrow only: from
``pipelines.train`` it brought torch, transformers and kvpop into each of those processes (~4 CPU-s apiece, per run).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of ``epoch`` (0-based) under ``train.shuffle_seed`` ``seed``: a permutation drawn from
    ``(seed, epoch)`` alone, so any step's rows are known without replaying the epochs before it."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_rows)


def row_order(num_rows: int, positions: np.ndarray, seed: int | None) -> np.ndarray:
    """The rows at ``positions`` of a run's row sequence: every row once per epoch, epoch after epoch, in file order
    (``seed`` None) or in :func:`epoch_permutation`'s order."""
    positions = np.asarray(positions, dtype=np.int64)
    epochs, within = np.divmod(positions, num_rows)
    if seed is None:
        return within
    out = np.empty_like(within)
    for epoch in np.unique(epochs):
        chosen = epochs == epoch
        out[chosen] = epoch_permutation(num_rows, seed, int(epoch))[within[chosen]]
    return out


class RowsByPosition:
    """Ray Data batch function: ``{"id": positions}`` (``ray.data.range``) → the rows at those positions of the
    run's row sequence (:func:`row_order`), from the online run's token ids (an object reference) or from the stored
    target files (each file read once per batch)."""

    def __init__(self, num_rows: int, seed: int | None, columns: list[str], ids_ref=None,
                 files: list[str] = (), file_rows: list[int] = ()):
        self.num_rows, self.seed, self.columns, self.ids_ref = num_rows, seed, columns, ids_ref
        self.files, self.starts = list(files), np.cumsum([0, *file_rows])

    def __call__(self, batch: dict) -> dict:
        import ray

        rows = row_order(self.num_rows, batch["id"], self.seed)
        if self.ids_ref is not None:
            return {"input_ids": ray.get(self.ids_ref)[rows]}
        file_of = np.searchsorted(self.starts, rows, side="right") - 1
        parts, where = [], []
        for f in np.unique(file_of):
            chosen = np.nonzero(file_of == f)[0]
            parts.append(pq.read_table(self.files[f], columns=self.columns).take(rows[chosen] - self.starts[f]))
            where.append(chosen)
        table = pa.concat_tables(parts).take(np.argsort(np.concatenate(where)))
        return {name: table.column(name).combine_chunks().to_numpy_ndarray() for name in self.columns}
