"""Build configuration (TOML): SID scheme, quality gates and k-way partitions.

Build-time settings only; query-time settings (beams, modes) belong to the runtime.

    [sid]       level sizes, the hashed final level, multi-path, balanced k-means, training
    [quality]   thresholds that fail the job (exit 3); omit a key to disable it
    [kway]      optional: k-way partitioned matchers (`sidindex.trie.kway`)

Every key is optional and unknown keys are errors. Every key, its default and meaning:
docs/cli.md ("Build config").
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

from sidindex.errors import ConfigError
from sidindex.tomlio import check_keys, read_toml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")  # a config section's dataclass

MAX_TOKEN = 32767  # tokens are stored as int16 (docs/design.md §5)


@dataclass(frozen=True)
class SIDConfig:
    levels: tuple[int, ...] = (512, 512, 512)
    hash_size: int = 512
    hash_keys: tuple[str, ...] = ("advertiser_id",)
    paths: int = 2
    path_ratio: float | None = None
    balanced: bool = True
    capacity: float = 1.1
    balanced_iters: int = 10
    train_sample: int = 131072
    niter: int = 20
    seed: int = 1234
    min_points_per_centroid: int = 39

    def __post_init__(self) -> None:
        where = "[sid]"
        if not _is_list(self.levels, lambda k: _is_int(k) and 1 <= k <= MAX_TOKEN + 1):
            raise ConfigError(f"{where} levels: expected a non-empty list of sizes in 1..{MAX_TOKEN + 1}, "
                              f"got {_shown(self.levels)}")
        if not _is_int(self.hash_size) or not 1 <= self.hash_size <= MAX_TOKEN + 1:
            raise ConfigError(f"{where} hash_size: expected an integer in 1..{MAX_TOKEN + 1}, "
                              f"got {_shown(self.hash_size)}")
        if not _is_list(self.hash_keys, lambda k: isinstance(k, str) and k != ""):
            raise ConfigError(f"{where} hash_keys: expected a non-empty list of column names, "
                              f"got {_shown(self.hash_keys)}")
        if math.prod(self.levels) * self.hash_size >= 2**63:
            raise ConfigError(f"{where} levels: the product of all level sizes must stay below 2^63 "
                              "(SIDs are keyed as one int64); use fewer or smaller levels")
        if not _is_int(self.paths) or not 1 <= self.paths <= 8:
            raise ConfigError(f"{where} paths: expected an integer in 1..8, got {_shown(self.paths)}")
        if self.path_ratio is not None and not (_is_num(self.path_ratio) and self.path_ratio >= 0):
            raise ConfigError(f"{where} path_ratio: expected a number >= 0, got {_shown(self.path_ratio)}")
        if not isinstance(self.balanced, bool):
            raise ConfigError(f"{where} balanced: expected true or false, got {_shown(self.balanced)}")
        if not _is_num(self.capacity) or not 1.0 <= self.capacity <= 100.0:
            raise ConfigError(f"{where} capacity: expected a number in [1, 100] (1 = perfectly "
                              f"balanced), got {_shown(self.capacity)}")
        for name, lo in (("balanced_iters", 0), ("train_sample", 1), ("niter", 1), ("seed", 0),
                         ("min_points_per_centroid", 1)):
            v = getattr(self, name)
            if not _is_int(v) or v < lo:
                raise ConfigError(f"{where} {name}: expected an integer >= {lo}, got {_shown(v)}")

    @property
    def sid_length(self) -> int:
        return len(self.levels) + 1


@dataclass(frozen=True)
class QualityThresholds:
    min_level_codes: int | None = 2
    max_sid_share: float | None = None
    min_level_perplexity: float | None = None

    def __post_init__(self) -> None:
        if self.min_level_codes is not None and (not _is_int(self.min_level_codes) or self.min_level_codes < 1):
            raise ConfigError(f"[quality] min_level_codes: expected an integer >= 1, "
                              f"got {_shown(self.min_level_codes)}")
        if self.max_sid_share is not None and not (_is_num(self.max_sid_share) and 0 < self.max_sid_share <= 1):
            raise ConfigError(f"[quality] max_sid_share: expected a number in (0, 1], "
                              f"got {_shown(self.max_sid_share)}")
        if self.min_level_perplexity is not None and not (_is_num(self.min_level_perplexity)
                                                          and self.min_level_perplexity >= 1):
            raise ConfigError(f"[quality] min_level_perplexity: expected a number >= 1, "
                              f"got {_shown(self.min_level_perplexity)}")


@dataclass(frozen=True)
class KWayConfig:
    mode: str = "static"                  # "static" or "dynamic"
    k: tuple[int, ...] = (64, 64, 32, 8)  # static: partitions per transition position
    k_max: int = 64                       # dynamic
    target_fill: float = 0.5              # dynamic

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in ("static", "dynamic"):
            raise ConfigError(f"[kway] mode: expected 'static' or 'dynamic', got {_shown(self.mode)}")
        if not _is_list(self.k, lambda v: _is_int(v) and v >= 1):
            raise ConfigError(f"[kway] k: expected a non-empty list of positive integers (one per position), "
                              f"got {_shown(self.k)}")
        if not _is_int(self.k_max) or self.k_max < 1:
            raise ConfigError(f"[kway] k_max: expected an integer >= 1, got {_shown(self.k_max)}")
        if not (_is_num(self.target_fill) and 0 < self.target_fill <= 1):
            raise ConfigError(f"[kway] target_fill: expected a number in (0, 1], got {_shown(self.target_fill)}")

    def k_at(self, position: int) -> int:
        """Partitions allowed at a transition position (static: the last k repeats)."""
        if self.mode == "dynamic":
            return self.k_max
        return self.k[min(position, len(self.k) - 1)]


@dataclass(frozen=True)
class BuildConfig:
    sid: SIDConfig = field(default_factory=SIDConfig)
    quality: QualityThresholds = field(default_factory=QualityThresholds)
    kway: KWayConfig | None = None  # k-way partitions, built when the config has a [kway] table

    def to_dict(self) -> dict:
        """The config as plain data (a snapshot's manifest keeps it as `build_config`)."""
        return {k: None if v is None else {f: list(x) if isinstance(x, tuple) else x
                                           for f, x in dataclasses.asdict(v).items()}
                for k, v in (("sid", self.sid), ("quality", self.quality), ("kway", self.kway))}

    @classmethod
    def from_dict(cls, doc: dict, where: str) -> BuildConfig:
        """`to_dict`'s inverse, checked as a config file is (a ConfigError naming `where` otherwise)."""
        check_keys(doc, {"sid", "quality", "kway"}, where)
        kway = doc.get("kway")
        return cls(sid=_section(doc, "sid", SIDConfig, where),
                   quality=_section(doc, "quality", QualityThresholds, where),
                   kway=None if kway is None else _section(doc, "kway", KWayConfig, where))


def load_config(path: str | Path | None) -> BuildConfig:
    """Read a build config; `None` gives the defaults. Unknown keys are errors (likely typos)."""
    if path is None:
        return BuildConfig()
    doc = read_toml(path, what="build config")
    check_keys(doc, {"sid", "quality", "kway"}, str(path))
    sid = _section(doc, "sid", SIDConfig, path)
    quality = _section(doc, "quality", QualityThresholds, path)
    kway = _section(doc, "kway", KWayConfig, path) if "kway" in doc else None
    return BuildConfig(sid=sid, quality=quality, kway=kway)


def _section(doc: dict, name: str, cls: type[_T], path: str | Path) -> _T:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{name}] must be a table")
    check_keys(table, {f.name for f in dataclasses.fields(cls)}, f"{path} [{name}]")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    """A finite number a float can hold (TOML integers have no bound: 1e400 as an int overflows later)."""
    try:
        return (_is_int(v) or isinstance(v, float)) and math.isfinite(float(v))
    except OverflowError:
        return False


def _is_list(v: object, each: Callable[[Any], bool]) -> bool:
    """Whether `v` is a non-empty list (a tuple, as `_section` passes it) whose every item passes `each`."""
    return isinstance(v, (tuple, list)) and len(v) > 0 and all(each(x) for x in v)


def _shown(v: object) -> str:
    """`v` as a message shows it: a list as written, long values cut short."""
    return reprlib.repr(list(v) if isinstance(v, tuple) else v)
