"""On-disk artifacts (codebooks, snapshots): the one place for reading files safely, sealing
manifests, checksumming and publishing directories atomically.

Reading: only regular files, never through a symbolic link, never waiting on a FIFO, with bounded
reads. Sealed manifests (`seal`, `read_sealed`): canonical JSON carrying `checksum`, the sha256 of
the canonical text of everything else; a reader refuses any text that is not byte-for-byte
canonical. Directories: every file but the manifest is listed with its size, sha256 and, for a
snapshot, its fast digest (`schemas.artifacts.FAST_DIGEST`); `verify_files` refuses a file
missing, changed, unlisted or not regular. `publish_dir` fsyncs a filled temporary directory and
renames it into place; `replace_file` does the same for one file (every file this project
replaces in place goes through it). What is refused and why, and the digests' speed:
docs/snapshot-format.md, "Opening" and "Publishing and retention"; the canonical form:
docs/contracts.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import shutil
import stat
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from pathlib import Path

import xxhash

from schemas.artifacts import FAST_DIGEST, FAST_DIGEST_CHUNK
from sidindex.errors import ArtifactError, ConfigError, InputError

MAX_MANIFEST_BYTES = 4 << 20
CHECKSUM_KEY = "checksum"
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
# Threads that hash (and, in `runtime.index.staging`, stage) an artifact: memory bandwidth is shared, so
# more than 16 add little, and a serving host keeps cores for the index it is still serving
THREADS = min(16, os.cpu_count() or 1)
MAPPED_BYTES = 1 << 29  # the digests map a next file only while under 512 MB are mapped


def open_regular(path: Path, *, follow_links: bool = False) -> int:
    """A read-only descriptor of the regular file at `path` (the caller closes it).

    Refuses a FIFO, a device, a directory or a socket without blocking, and a symbolic link (as
    the last component) unless `follow_links` (a user's input, not an artifact), naming the path.
    """
    try:
        fd = os.open(path, _FLAGS & ~os.O_NOFOLLOW if follow_links else _FLAGS)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ArtifactError(f"{path}: is a symbolic link; artifacts are read from regular files only") from None
        raise ArtifactError(f"{path}: cannot be opened ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ArtifactError(f"{path}: is {_kind(mode)}; artifacts are read from regular files only")
    return fd


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at `path`, refused when longer than `limit`."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ArtifactError(f"{path}: {size} bytes, more than the {limit} a file of this kind may hold")
        data = os.read(fd, limit + 1)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # grew since fstat
        raise ArtifactError(f"{path}: more than the {limit} bytes a file of this kind may hold")
    return data


def sha256_file(path: Path, *, follow_links: bool = False) -> str:
    """Hex sha256 of the regular file at `path` (through a link only with `follow_links`)."""
    fd = open_regular(path, follow_links=follow_links)
    h = hashlib.sha256()
    try:
        while block := os.read(fd, 1 << 20):
            h.update(block)  # releases the GIL: files hash in parallel threads
        return h.hexdigest()
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: creations and renames in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- sealed manifests -------------------------------------------------------------------------

def _canonical(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def seal(doc: dict) -> bytes:
    """The manifest text of `doc` (which must not hold CHECKSUM_KEY), with its checksum added."""
    body = {k: v for k, v in doc.items() if k != CHECKSUM_KEY}
    text = _canonical({**body, CHECKSUM_KEY: hashlib.sha256(_canonical(body)).hexdigest()})
    _note_sealed(hashlib.sha256(text).digest())  # a reader of these bytes need not encode them again
    return text


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"key {k!r} appears twice")
            seen.add(k)
    return out


def read_json(path: Path, what: str) -> tuple[dict, bytes]:
    """(document, raw bytes) of the JSON object at `path`: bounded in size and nesting, no duplicate keys."""
    raw = read_bounded(path, MAX_MANIFEST_BYTES)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{path}: not valid {what} manifest JSON ({e})") from None
    except RecursionError:  # the parser's own bound on nesting, long before memory or the stack
        raise ArtifactError(f"{path}: nested too deeply; not a sidindex {what} manifest") from None
    if not isinstance(doc, dict):
        raise ArtifactError(f"{path}: not a sidindex {what} manifest (not a JSON object)")
    return doc, raw


def read_sealed(path: Path, fmt: str, version: int | tuple[int, ...], what: str, *,
                gone: dict[int, str] | None = None, unsealed: int | None = None) -> dict:
    """The manifest at `path`, of format `fmt` at `version` (one, or the tuple of those read):
    `read_json`, then byte-for-byte canonical with the right checksum. A manifest without a checksum
    is refused saying which format version it is, unless it is of version `unsealed` (an older
    format still read as it is)."""
    doc, raw = read_json(path, what)
    if CHECKSUM_KEY not in doc:
        check_format(path, doc, fmt, unsealed if unsealed is not None else version, what, gone)
        if unsealed is None:
            raise ArtifactError(f"{path}: not a sealed sidindex {what} manifest (no '{CHECKSUM_KEY}')")
        return doc
    digest = hashlib.sha256(raw).digest()
    if digest not in _SEALED:  # the same bytes are sealed whoever reads them: json's indenting encoder is slow
        try:
            canonical = seal(doc)
        except (TypeError, ValueError) as e:  # NaN or infinity, a checksum that is not a string
            raise ArtifactError(f"{path}: not a sidindex {what} manifest ({e})") from None
        if canonical != raw:
            raise ArtifactError(f"{path}: the {what} manifest is corrupt (its checksum or its bytes do not match)")
        _note_sealed(digest)
    check_format(path, doc, fmt, version, what, gone)
    return doc


def _note_sealed(digest: bytes) -> None:
    with _SEALED_LOCK:
        if len(_SEALED) >= _SEALED_MOST:
            _SEALED.clear()
        _SEALED.add(digest)


# sha256 of manifest texts found sealed (byte-for-byte canonical with the right checksum): a job or a
# load reads one manifest several times, and re-encoding it is most of a read
_SEALED: set[bytes] = set()
_SEALED_LOCK = threading.Lock()
_SEALED_MOST = 256


def check_format(path: Path, doc: dict, fmt: str, version: int | tuple[int, ...], what: str,
                 gone: dict[int, str] | None = None) -> None:
    """Refuse a manifest of another format, or of a format version other than `version` (one, or
    the tuple of those read), saying which to do."""
    if doc.get("format") != fmt:
        raise ArtifactError(f"{path}: not a sidindex {what} manifest (format {str(doc.get('format'))[:80]!r})")
    found = doc.get("format_version")
    versions = version if isinstance(version, tuple) else (version,)
    if found in versions and not isinstance(found, bool):
        return
    *head, last = map(str, versions)
    read = f"{', '.join(head)} or {last}" if head else last
    found_int = found if isinstance(found, int) and not isinstance(found, bool) else None
    if found_int is not None and found_int > max(versions):
        raise ArtifactError(f"{path}: {what} format version {found}; this sidindex reads version {read} "
                            "(written by a newer sidindex: upgrade sidindex)")
    hint = (gone or {}).get(found_int) if found_int is not None else None
    raise ArtifactError(f"{path}: {what} format version {str(found)[:40]!r}; this sidindex reads version {read}"
                        + (f" ({hint})" if hint else ""))


# --- directories ------------------------------------------------------------------------------

MAX_NESTING = 4  # an artifact's own folders (a snapshot's codebooks/<id>/) are two deep


def _walk(directory: Path, skip: str | Collection[str], depth: int = 0) -> dict[str, Path]:
    """Every entry below `directory` as relative POSIX path -> path, except the files `skip` names
    at its top (one name, or several); refuses
    anything that is not a regular file or a directory (symlinks included), and folders nested
    deeper than an artifact's, naming it."""
    if depth > MAX_NESTING:
        raise ArtifactError(f"{directory}: folders nested deeper than any artifact's")
    out: dict[str, Path] = {}
    skipped = {skip} if isinstance(skip, str) else set(skip)
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        raise ArtifactError(f"{directory}: cannot be listed ({e.strerror})") from None
    for entry in entries:
        path = Path(entry.path)
        if entry.is_symlink():
            raise ArtifactError(f"{path}: is a symbolic link; an artifact holds regular files only")
        if entry.is_dir(follow_symlinks=False):
            out |= {f"{entry.name}/{k}": p for k, p in _walk(path, (), depth + 1).items()}
        elif entry.is_file(follow_symlinks=False):
            if entry.name not in skipped:
                out[entry.name] = path
        else:
            raise ArtifactError(f"{path}: is not a regular file; an artifact holds regular files only")
    return out


def _map_file(path: Path) -> mmap.mmap | None:
    """A read-only map of the regular file at `path` (None when empty: nothing to map)."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size == 0:
            return None
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        mm.madvise(mmap.MADV_SEQUENTIAL)  # each chunk is read once, front to back
        # and read ahead now: pages not cached are then read in large requests while earlier chunks
        # hash, not faulted in a page or a readahead window at a time (cached ones cost a lookup)
        with contextlib.suppress(OSError):  # a hint: a file that refuses it is still read
            mm.madvise(mmap.MADV_WILLNEED)
        return mm
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)


def _chunk_digest(mm: mmap.mmap, start: int) -> bytes:
    # hashing a view of the map reads the page cache in place (no copy, unlike a read into a
    # buffer); xxhash releases the GIL, so chunks hash in parallel threads
    with memoryview(mm)[start:start + FAST_DIGEST_CHUNK] as chunk:
        return xxhash.xxh3_128(chunk).digest()


def _fast_digests(pool: ThreadPoolExecutor, paths: list[Path], stop: threading.Event | None = None) -> list[str]:
    """The fast digest (`schemas.artifacts.FAST_DIGEST`) of each of `paths`: every file's chunks
    are queued on `pool` as soon as it is mapped, so one large file does not bound the time. The
    pages a map has read count as this process's memory until it closes, and a snapshot's files
    mapped all at once would add their whole size to its peak: before the next file is mapped, the
    oldest files are finished and closed until under MAPPED_BYTES stay mapped. The pool never
    drains at a group's end: the files mapped meanwhile are queued behind the oldest's chunks.
    `stop` set: CancelledError at the next chunk waited for (the chunks queued are cancelled)."""
    out: list[str] = []
    maps: deque[tuple[mmap.mmap | None, list[Future]]] = deque()
    mapped = 0

    def finish_oldest() -> None:
        nonlocal mapped
        mm, chunks = maps[0]
        digests = []
        for f in chunks:
            _stopped(stop)
            digests.append(f.result())
        out.append(xxhash.xxh3_128(b"".join(digests)).hexdigest())
        maps.popleft()
        if mm is not None:
            mapped -= len(mm)
            mm.close()

    try:
        for path in paths:
            while maps and mapped >= MAPPED_BYTES:
                finish_oldest()
            _stopped(stop)
            mm = _map_file(path)
            chunks: list[Future] = []
            maps.append((mm, chunks))  # tracked before its chunks are queued: `_close` finds them all
            if mm is not None:
                mapped += len(mm)
                for start in range(0, len(mm), FAST_DIGEST_CHUNK):
                    chunks.append(pool.submit(_chunk_digest, mm, start))
        while maps:
            finish_oldest()
        return out
    finally:
        _close([mm for mm, _ in maps], [chunks for _, chunks in maps])


def _stopped(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise CancelledError("the digests were stopped")


def _close(maps: list[mmap.mmap | None], futures: list[list[Future]]) -> None:
    """Close `maps` once no thread reads them: the hashing not yet started is cancelled."""
    queued = [f for file in futures for f in file]
    for f in queued:
        f.cancel()
    wait(queued)
    for mm in maps:
        if mm is not None:
            mm.close()


def fast_digest(path: Path) -> str:
    """The fast digest of the regular file at `path` (hex)."""
    with _pool() as pool:
        return _fast_digests(pool, [path])[0]


@contextlib.contextmanager
def _pool() -> Iterator[ThreadPoolExecutor]:
    """A pool of THREADS hashing threads; leaving early cancels the hashing not yet started."""
    pool = ThreadPoolExecutor(THREADS)
    try:
        yield pool
    finally:
        pool.shutdown(cancel_futures=True)


def list_files(directory: Path, skip: str | Collection[str], known: dict[str, dict] | None = None, *,
               fast: bool = False, only: Collection[str] | None = None) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}, with `fast` also FAST_DIGEST} of every file below
    `directory` but `skip` (of the relative paths `only`, when given: files others may be writing
    beside them are neither walked nor read); a file in `known` (linked from a checked artifact)
    keeps its entry there instead of being hashed, when that entry has every digest asked for."""
    keys = {"bytes", "sha256"} | ({FAST_DIGEST} if fast else set())
    known = {n: e for n, e in (known or {}).items() if set(e) == keys}
    found = _walk(directory, skip) if only is None else {n: directory / n for n in only}
    files = dict(sorted(found.items()))
    hashed = [n for n in files if n not in known]
    paths = [files[n] for n in hashed]
    with _pool() as pool:
        out = {n: {"bytes": files[n].stat().st_size, "sha256": d}
               for n, d in zip(hashed, pool.map(sha256_file, paths))}
        if fast:
            for n, d in zip(hashed, _fast_digests(pool, paths)):
                out[n][FAST_DIGEST] = d
    return {n: out[n] if n in out else dict(known[n]) for n in files}


def same_file(a: Path, b: Path) -> bool:
    """Whether paths a and b are one file (hard links of one inode); False when either is gone."""
    try:
        sa, sb = a.stat(follow_symlinks=False), b.stat(follow_symlinks=False)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def link_file(src: Path, dst: Path) -> None:
    """Hard-link src at dst (a copy where the file system cannot link)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def verify_files(directory: Path, listed: dict[str, dict], skip: str | Collection[str], *, checksums: bool = True,
                 strong: bool = False, trusted: frozenset[str] = frozenset()) -> None:
    """Refuse unless the files below `directory` (but `skip`) are exactly `listed`, each of the
    listed size and, with `checksums`, digest: FAST_DIGEST where the entry has it, sha256 where
    not, and with `strong` sha256 as well (read in parallel, stopping at the first mismatch); files
    in `trusted` (one file with one already checked) skip the checksum."""
    found = _walk(directory, skip)
    unlisted = sorted(set(found) - set(listed))
    if unlisted:
        raise ArtifactError(f"{directory / unlisted[0]}: not listed in the manifest; an artifact holds only the "
                            "files its manifest lists")
    for name, entry in listed.items():
        path = directory / name
        try:
            size = found[name].stat(follow_symlinks=False).st_size
        except (KeyError, FileNotFoundError):  # gone since it was listed: a directory being deleted, too
            raise ArtifactError(f"{path}: missing (the manifest lists it)") from None
        if size != entry["bytes"]:
            raise ArtifactError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or replaced?)")
    if checksums:
        verify_checksums(directory, listed, strong=strong, trusted=trusted)


def verify_checksums(directory: Path, listed: dict[str, dict], *, strong: bool = False,
                     trusted: frozenset[str] = frozenset(), stop: threading.Event | None = None) -> None:
    """The checksums of `verify_files`, of files it already found listed and sized. `stop` set
    (another thread interrupted): CancelledError at the next chunk or file waited for."""
    names = [n for n in listed if n not in trusted]
    fast = [n for n in names if FAST_DIGEST in listed[n]]
    slow = [n for n in names if strong or FAST_DIGEST not in listed[n]]
    with _pool() as pool:
        for kind, todo in ((FAST_DIGEST, fast), ("sha256", slow)):
            paths = [directory / n for n in todo]
            digests = _fast_digests(pool, paths, stop) if kind == FAST_DIGEST else pool.map(sha256_file, paths)
            for name, digest in zip(todo, digests):
                _stopped(stop)
                if digest != listed[name][kind]:
                    raise ArtifactError(f"{directory / name}: checksum mismatch ({kind}); the file is corrupt")


def publish_dir(tmp: Path, final: Path) -> None:
    """fsync every file and directory below the filled `tmp`, rename it to `final`, fsync the parent.
    A crash at any point leaves either no `final` or a complete one."""
    fsync_tree(tmp)
    rename_synced(tmp, final)


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory below `directory`, and it. A file with another link is one
    hard-linked from a published artifact (`link_file`), synced when that one was published: its
    new name is made durable by syncing the directory that holds it, and syncing the file again
    would only commit the link count (a journal commit per file, most of an update's sync)."""
    for p in sorted(directory.rglob("*"), reverse=True):  # files before the directories holding them
        st = p.lstat()
        if stat.S_ISDIR(st.st_mode) or st.st_nlink == 1:
            fsync_path(p)
    fsync_path(directory)


def rename_synced(tmp: Path, final: Path) -> None:
    """Rename the synced `tmp` to `final` and fsync the parent (the rename itself)."""
    os.rename(tmp, final)
    fsync_path(final.parent)


def temporary_file(path: Path) -> Path:
    """Where `replace_file` writes the next content of `path` (what a crash may leave behind)."""
    return path.with_name(path.name + ".tmp")


def replace_file(path: Path, write: Callable[[Path], object]) -> None:
    """Replace the file at `path` in one step that survives a crash: `write` fills the temporary
    file beside it (`temporary_file`, the same file system, so the rename is atomic), which is
    fsynced, renamed over `path`, and the directory fsynced (the rename itself). A reader sees the
    old file or the new one, never part of one; a failure or an interrupt removes the temporary."""
    tmp = temporary_file(path)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the first error is the one to report
            tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def regular_input(path: str | Path, what: str) -> Path:
    """`path` if it names a regular file (links followed); else InputError naming it and what it is
    (missing, a directory, a FIFO, a device, a socket). `what` names the input ("catalog", "change file").

    Checked with stat, never by opening: opening a FIFO blocks until something writes to it.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        where = "a symbolic link to no file" if path.is_symlink() else f"no {what} at this path"
        raise InputError(f"{path}: file not found ({where})") from None
    except OSError as e:
        raise InputError(f"{path}: the {what} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: the {what} is {_kind(mode)}; it must be a regular file (or a symbolic link to one)")
    return path


def regular_output(path: Path) -> Path:
    """`path` if it is a new path or a regular file (links followed: the file written replaces a
    link, its target left as it was), and so is the temporary it is written to first
    (`temporary_file`); else ConfigError naming it: a FIFO, directory, device or socket must not be
    replaced by a file, nor a FIFO block the writer. Checked with stat, never by opening."""
    for p in (path, temporary_file(path)):
        try:
            mode = p.stat().st_mode
        except FileNotFoundError:  # a new path (or a link to no file, which the rename replaces)
            continue
        except OSError as e:
            raise ConfigError(f"{p}: cannot be checked as an output file ({e.strerror}); choose another path") from None
        if not stat.S_ISREG(mode):
            role = "" if p == path else f"the temporary that {path.name!r} is written to first, "
            raise ConfigError(f"{p}: {role}is {_kind(mode)}; an output file must be a new path or a regular file, so "
                              "it was left as it is: choose another path, or remove it first")
    return path


def _kind(mode: int) -> str:
    """What a file that is not regular is, from its st_mode."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
