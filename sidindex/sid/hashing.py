"""The final SID level: mmh3 of the ad's hash-key columns, modulo the level size.

Key text: each key column's value as text (integers in decimal, strings as they are), joined by
the unit separator U+001F, encoded as UTF-8. Token = mmh3_x86_32(key, seed=HASH_SEED, unsigned) % size.
Changing HASH_SEED or the key text changes every SID: both are part of the codebook format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import polars as pl

HASH_SEED = 0x5EED51D
KEY_SEPARATOR = "\x1f"


def hash_key_text(columns: pl.DataFrame, keys: tuple[str, ...]) -> pl.Series:
    """(N,) string Series: the key text of each row (see module docstring)."""
    import polars as pl  # the hashed level is assigned when building; a codebook's reader needs neither

    return columns.select(
        pl.concat_str([pl.col(k).cast(pl.String) for k in keys], separator=KEY_SEPARATOR).alias("key")
    ).to_series()


def hash_tokens(columns: pl.DataFrame, keys: tuple[str, ...], size: int) -> np.ndarray:
    """(N,) int16 final-level tokens in [0, size). Each distinct key is hashed once."""
    import mmh3
    import polars as pl

    text = hash_key_text(columns, keys)
    distinct = text.unique()
    tokens = [mmh3.hash(s, HASH_SEED, signed=False) % size for s in distinct.to_list()]
    mapped = text.replace_strict(distinct, pl.Series(tokens, dtype=pl.Int16), return_dtype=pl.Int16)
    return mapped.to_numpy()
