"""The journal of change files is what the published snapshots record (docs/design.md §15):

- Tampering with ROOT/changes cannot lose or invent a change. A recorded entry deleted, or its file
  edited (renamed to its new sha256 or not), refuses the build that must re-apply it: exit 2, one
  line naming it, nothing published. An entry no snapshot records (a forged file under a published
  update's id, with a correct sha256) is never applied, and the build's warning names it.
- Replay follows publication order, not file names; a watermark naming no change file the journal
  holds is refused.
- A property test interleaves updates, tampering and full builds from exports of any age: after
  every step the build refused with one line, or the live ads are the catalog's minus the paused
  and deleted ones, and no forged change was ever applied.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import shutil
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidindex.errors import SidIndexError
from sidindex.job import run_build, run_update
from sidindex.root import Root
from sidindex.snapshot import open_snapshot
from tests.conftest import run_cli
from tests.test_changes_survive import _export, _live, _published, _root, watermarked  # noqa: F401 (fixture)
from tests.test_update import N_BASE, _changes, built, pool  # noqa: F401 (fixtures)


def _entries(root: Path) -> list:
    journal = open_snapshot(root, verify=False).manifest.journal
    assert journal is not None
    return list(journal.entries)


def _entry_file(root: Path, k: int) -> Path:
    r = _entries(root)[k]
    return Root(root).entry_dir(r.update, r.sha256) / r.name


def _forge(pool, root: Path, update: str, rows: list[dict], tmp: Path, name: str = "forged.parquet") -> Path:
    """A journal entry under a published update's id, holding a change file whose sha256 is right."""
    made = _changes(pool, tmp / name, rows)
    digest = hashlib.sha256(made.read_bytes()).hexdigest()
    entry = Root(root).entry_dir(update, digest)
    entry.mkdir(exist_ok=True)  # the same rows forged twice under one update: one entry
    return Path(shutil.copy(made, entry / name))


@pytest.fixture
def journaled(watermarked, pool, tmp_path):
    """A ROOT watermarked through 0000.parquet, then 0001 (pause 3 ads) and 0002 (delete 2) published."""
    root = _root(watermarked, tmp_path)
    ids = pool["catalog"]["ad_id"].head(N_BASE).to_list()
    run_update(root, _changes(pool, tmp_path / "0001.parquet", [{"ad_id": a, "op": "pause"} for a in ids[:3]]))
    run_update(root, _changes(pool, tmp_path / "0002.parquet", [{"ad_id": a, "op": "delete"} for a in ids[3:5]]))
    export = _export(pool, tmp_path, pool["catalog"].head(N_BASE), "export.parquet")  # holds neither file
    return root, ids, export


def _rebuild(pool, root: Path, export: Path, through: str = "0000.parquet"):
    return run_cli("build", "--catalog", export, "--targeting", pool["targeting"], "--out", root, "--config",
                   pool["dir"] / "build.toml", "--force", "--json", "--changes-applied-through", through)


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("tamper", ["deleted", "edited", "edited and renamed"])
def test_a_recorded_change_file_that_is_gone_or_changed_refuses_the_build(journaled, pool, tmp_path, tamper):
    root, ids, export = journaled
    victim = _entry_file(root, 1)
    if tamper == "deleted":
        shutil.rmtree(victim.parent)
    else:  # 0002 now deletes other ads
        victim.chmod(0o644)
        _changes(pool, victim, [{"ad_id": a, "op": "delete"} for a in ids[10:20]])
        if tamper == "edited and renamed":
            victim.parent.rename(Root(root).entry_dir(_entries(root)[1].update,
                                                      hashlib.sha256(victim.read_bytes()).hexdigest()))
    before = _published(root)
    r = _rebuild(pool, root, export)
    assert r.returncode == 2, r.stderr
    line = _one_line(r.stderr)
    assert str(victim) in line and ("missing" if tamper != "edited" else "not those update") in line, line
    assert _published(root) == before


def test_a_forged_entry_is_never_applied_and_is_named(journaled, pool, tmp_path):
    root, ids, export = journaled
    forged = _forge(pool, root, _entries(root)[1].update, [{"ad_id": a, "op": "delete"} for a in ids[10:20]], tmp_path)
    r = _rebuild(pool, root, export)
    assert r.returncode == 0, r.stderr
    assert f"{forged.parent}: a journal entry the published snapshot does not record" in r.stderr
    assert _live(root) == set(ids[5:])  # 0001's pauses and 0002's deletes, nothing of the forgery
    assert [e.name for e in _entries(root)] == ["0001.parquet", "0002.parquet"]


def test_replay_follows_publication_order_not_names(watermarked, pool, tmp_path):
    root = _root(watermarked, tmp_path)
    ids = pool["catalog"]["ad_id"].head(N_BASE).to_list()
    run_update(root, _changes(pool, tmp_path / "b_pause20.parquet", [{"ad_id": a, "op": "pause"} for a in ids[:20]]))
    run_update(root, _changes(pool, tmp_path / "b_delete10.parquet",
                              [{"ad_id": a, "op": "delete"} for a in ids[20:30]]))  # sorts first, published last
    export = _export(pool, tmp_path, pool["catalog"].head(N_BASE), "export.parquet")
    r = _rebuild(pool, root, export, "b_pause20.parquet")
    assert r.returncode == 0, r.stderr
    assert _live(root) == set(ids[30:])  # the pauses carried, the later delete applied again


@pytest.mark.parametrize("through", ["never-published.parquet", "0000.parquet"])
def test_a_watermark_the_journal_does_not_hold_is_refused(journaled, pool, tmp_path, through):
    """A name no update published; and, once a build told 0002, the older 0000 (the export predates
    the last build's)."""
    root, ids, export = journaled
    if through == "0000.parquet":
        assert _rebuild(pool, root, export, "0002.parquet").returncode == 0
    before = _published(root)
    r = _rebuild(pool, root, export, through)
    assert r.returncode == 2 and f"{through!r}, a name the ROOT's journal does not hold" in _one_line(r.stderr)
    assert _published(root) == before


# --- interleaved: updates, tampering and full builds ------------------------------------------------

STEP = st.one_of(
    st.tuples(st.just("update"), st.sampled_from(["pause", "resume", "delete"]), st.integers(0, 10**6)),
    st.tuples(st.just("tamper"), st.sampled_from(["delete", "forge", "rename"]), st.integers(0, 10**6)),
    st.tuples(st.just("build"), st.integers(0, 3), st.integers(0, 1)),
)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps=st.lists(STEP, min_size=2, max_size=9))
def test_tampering_never_loses_or_invents_a_change(watermarked, pool, tmp_path_factory, steps):
    tmp = tmp_path_factory.mktemp("tampered")
    root = _root(watermarked, tmp)
    catalog = [pool["catalog"].head(N_BASE)]  # the catalog after each change file (pauses are not in it)
    names = ["0000.parquet"]  # catalog[k] holds every change up to names[k]
    paused: set[int] = set()
    damaged: dict[str, Path] = {}  # change file name -> a copy of its journal entry, moved or deleted
    through = 0  # the newest export a build was told
    saves = itertools.count()

    def check() -> None:
        assert _live(root) == set(catalog[-1]["ad_id"].to_list()) - paused

    for kind, a, b in steps:
        if kind == "update":
            ids = catalog[-1]["ad_id"].to_list()
            ad = ids[b % len(ids)]
            names.append(f"{len(names):04d}.parquet")
            run_update(root, _changes(pool, tmp / names[-1], [{"ad_id": ad, "op": a}]))
            now = catalog[-1]
            if a == "delete":
                now = now.filter(pl.col("ad_id") != ad)
                paused.discard(ad)
            elif a == "pause":
                paused.add(ad)
            else:
                paused.discard(ad)
            catalog.append(now)
        elif kind == "tamper":
            entries = _entries(root)
            if not entries:
                continue
            r = entries[b % len(entries)]
            entry = Root(root).entry_dir(r.update, r.sha256)
            ids = catalog[-1]["ad_id"].to_list()
            forged = [{"ad_id": ids[b % len(ids)], "op": "delete"}]  # never to be applied
            if a == "forge":
                _forge(pool, root, r.update, forged, tmp, f"forged-{b}.parquet")
            elif r.name not in damaged:
                # a fresh name: an entry restored earlier may be damaged again with the same b
                damaged[r.name] = Path(shutil.copytree(entry, tmp / f"saved-{r.name}-{next(saves)}"))
                if a == "delete":
                    shutil.rmtree(entry)
                else:  # edited, then renamed to its new sha256
                    f = entry / r.name
                    f.chmod(0o644)
                    _changes(pool, f, forged)
                    entry.rename(Root(root).entry_dir(r.update, hashlib.sha256(f.read_bytes()).hexdigest()))
        else:
            k = max(0, len(catalog) - 1 - a)
            export = _export(pool, tmp, catalog[k], f"export{len(names)}.parquet")
            before = _published(root)
            needed = {n for n in names[k + 1:] if n in {e.name for e in _entries(root)}}
            build = functools.partial(run_build, export, pool["targeting"], root, config=pool["dir"] / "build.toml",
                                      codebook=root, force=True, changes_through=names[k])
            if k < through or needed & set(damaged):
                with pytest.raises(SidIndexError) as e:
                    build()
                assert "\n" not in str(e.value) and _published(root) == before
                if b:  # restore what was damaged, as an operator would
                    for name, saved in damaged.items():
                        r = next(r for r in _entries(root) if r.name == name)
                        for p in (root / "changes").glob(f"{r.update}.*"):  # what replaced it, forgeries too
                            shutil.rmtree(p)
                        shutil.copytree(saved, Root(root).entry_dir(r.update, r.sha256))
                    damaged.clear()
            else:
                report = build()
                assert report["carried"]["replayed"] == names[k + 1:]
                through = k
                damaged = {n: p for n, p in damaged.items() if n in {e.name for e in _entries(root)}}
        check()


# --- ROOT's own directories --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["snapshots", "changes", "codebooks", "checked"])
def test_a_root_directory_linked_out_of_the_root_is_refused_everywhere(journaled, pool, tmp_path, name):
    """Its snapshots, journal, codebooks and check records are read from ROOT's own directories:
    moved out and linked back, every reader (validate, load, a watcher's poll) and writer (update,
    build) refuses, with one line naming the link."""
    import runtime

    root, ids, export = journaled
    watcher = runtime.SnapshotWatcher(root, "cpu")
    if not (root / name).exists():
        (root / name).mkdir()
    outside = Path(shutil.move(root / name, tmp_path / f"elsewhere-{name}"))
    (root / name).symlink_to(outside)
    message = f"{root / name}: a symbolic link out of its ROOT"
    for args in (("validate", root), ("update", root, "--changes", _changes(pool, tmp_path / "0003.parquet", [
            {"ad_id": ids[7], "op": "pause"}])), ("build", "--catalog", export, "--targeting", pool["targeting"],
                                                   "--out", root, "--config", pool["dir"] / "build.toml", "--force")):
        r = run_cli(*args)
        assert r.returncode == 2 and message in _one_line(r.stderr), (args[0], r.stderr)
    for path in (root, Root(root).snapshot_dir(Root(root).current_id())):  # a ROOT, or a snapshot in it
        with pytest.raises(SidIndexError, match="a symbolic link out of its ROOT"):
            runtime.load(path, "cpu")
    (root / "CURRENT").write_text(Root(root).history()[-2] + "\n")  # something new to poll
    assert watcher.poll() is False and "a symbolic link out of its ROOT" in (watcher.last_error or "")


def test_a_root_from_before_the_recorded_journal_is_read_once_and_recorded(journaled, pool, tmp_path):
    """Format version 8 kept the journal as a listing and THROUGH: a build over one reads them, says
    so, and records the journal; THROUGH goes."""
    from schemas.artifacts import SHARDED_VERSION
    from tests.test_snapshot import reseal

    root, ids, export = journaled
    current = Root(root).snapshot_dir(Root(root).current_id())
    reseal(current, lambda m: (m.pop("journal"), m.__setitem__("format_version", SHARDED_VERSION)))
    (root / "changes" / "THROUGH").write_text("0000.parquet\n")
    assert open_snapshot(root).manifest.journal is None
    r = _rebuild(pool, root, export, "0001.parquet")
    assert r.returncode == 0 and "records no journal" in r.stderr, r.stderr
    assert _live(root) == set(ids[5:])  # 0002's deletes applied again (0001's pauses carried)
    assert [e.name for e in _entries(root)] == ["0002.parquet"] and not (root / "changes" / "THROUGH").exists()


def test_a_build_applies_the_bytes_it_checked(journaled, pool, tmp_path, monkeypatch):
    """The journal's files are checked and applied from private copies: one rewritten in ROOT after
    the check (the build runs minutes in between) changes nothing."""
    import sidindex.job as job

    root, ids, export = journaled
    victim = _entry_file(root, 1)
    carry = job._carry_changes

    def swapped(*args, **kwargs):
        victim.chmod(0o644)
        _changes(pool, victim, [{"ad_id": a, "op": "delete"} for a in ids[10:60]])
        return carry(*args, **kwargs)

    monkeypatch.setattr(job, "_carry_changes", swapped)
    run_build(export, pool["targeting"], root, config=pool["dir"] / "build.toml", codebook=root, force=True,
              changes_through="0000.parquet")
    assert _live(root) == set(ids[5:])


def test_an_update_applies_the_bytes_it_digested(journaled, pool, tmp_path, monkeypatch):
    """An update reads, digests and journals one private copy: its staged copy in ROOT rewritten
    while the base is verified is not what it applies."""
    import sidindex.job as job

    root, ids, _ = journaled
    opened = job.open_snapshot

    def rewrite_staged(*args, **kwargs):
        for f in (root / "changes").glob(".tmp-*/*"):
            _changes(pool, f, [{"ad_id": a, "op": "delete"} for a in ids[10:60]])
        return opened(*args, **kwargs)

    monkeypatch.setattr(job, "open_snapshot", rewrite_staged)
    report = run_update(root, _changes(pool, tmp_path / "0003.parquet", [{"ad_id": ids[7], "op": "pause"}]))
    assert report["changes"]["pause"] == 1 and report["changes"]["delete"] == 0
    assert _live(root) == set(ids[5:]) - {ids[7]}


def test_a_rolled_back_current_keeps_the_journal_of_what_published(journaled, pool, tmp_path):
    """CURRENT moved back over a published update: the next writer keeps that update's journal
    entry (HISTORY names it), and builds name it as unrecorded rather than losing it silently."""
    root, ids, export = journaled
    second = _entries(root)[1]
    (root / "CURRENT").write_text(_entries(root)[0].update + "\n")
    run_update(root, _changes(pool, tmp_path / "0003.parquet", [{"ad_id": ids[7], "op": "pause"}]))
    assert Root(root).entry_dir(second.update, second.sha256).is_dir()
    r = _rebuild(pool, root, export)
    assert r.returncode == 0 and f"{second.update}.{second.sha256}: a journal entry the published snapshot" in r.stderr


def test_a_watermark_names_the_newest_entry_of_its_name():
    from sidindex.snapshot.manifest import Journal, JournalRecord

    a, b, c = (JournalRecord(f"20260101T00000000000{k}Z-0000000{k}", n, f"{k}" * 64)
               for k, n in ((1, "x.parquet"), (2, "w.parquet"), (3, "x.parquet")))
    journal = Journal("x.parquet", (a, b, c))  # a watermark and two later entries of the same name
    assert journal.since("x.parquet") == ()
    assert journal.since("w.parquet") == (c,)
    with pytest.raises(ValueError):
        journal.since("y.parquet")
