"""Matcher-table dedup against numpy's exact row unique, including forced hash-slot collisions."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sidindex.trie.dedup import RowTable


def dedup_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows, index) through a RowTable sized for all of `rows`."""
    table = RowTable(rows.shape[1], len(rows))
    index = table.add(rows)
    return table.table(), index


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), w=st.integers(1, 4), distinct=st.integers(1, 20), seed=st.integers(0, 10_000))
def test_dedup_matches_exact_unique(n, w, distinct, seed):
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**64, size=(distinct, w), dtype=np.uint64)
    pool[0] = 0  # include the all-zero and all-ones rows, common in matcher tables
    pool[-1] = np.uint64(2**64 - 1)
    rows = pool[rng.integers(0, distinct, n)]
    table, index = dedup_rows(rows)
    assert index.dtype == np.int32 and index.shape == (n,)
    np.testing.assert_array_equal(table[index], rows)
    assert len(table) == len(np.unique(rows, axis=0)) if n else len(table) == 0
    # first-occurrence order
    _, first = np.unique(index, return_index=True)
    assert np.all(np.diff(first) > 0) if len(first) else True


def test_rows_differing_in_one_bit_stay_apart():
    rows = np.zeros((64, 3), dtype=np.uint64)
    rows[np.arange(64), 2] = np.uint64(1) << np.arange(64, dtype=np.uint64)
    table, index = dedup_rows(np.concatenate([rows, rows]))
    assert len(table) == 64
    np.testing.assert_array_equal(index, np.tile(np.arange(64), 2))


@settings(max_examples=30, deadline=None)
@given(batches=st.lists(st.integers(0, 40), min_size=1, max_size=6), distinct=st.integers(1, 30),
       seed=st.integers(0, 10_000))
def test_row_table_grows_without_renumbering(batches, distinct, seed):
    """Rows added in batches to a table that starts too small keep the numbers they were given."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**64, size=(distinct, 2), dtype=np.uint64)
    table = RowTable(2, 1)
    added, numbers = [], []
    for n in batches:
        rows = pool[rng.integers(0, distinct, n)]
        numbers.append(table.add(rows))
        added.append(rows)
    final = table.table()
    for rows, idx in zip(added, numbers):
        np.testing.assert_array_equal(final[idx], rows)
    assert len(final) == len(np.unique(np.concatenate(added), axis=0))
