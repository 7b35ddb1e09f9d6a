"""Where the tool writes, and what it never overwrites.

Every output (a cube, an ``optimize.zarr``, a report folder) is built under a
temporary name beside its target and moved into place when complete. Around
that, three rules keep a user's files safe:

* **Only the tool's own outputs are replaced.** Every output the tool writes
  is marked with its kind (``KINDS``) and the identity (inode) of the folder
  it was written in: a zarr store by its root attribute ``sweep_output``
  (``MARKER``), a report folder by a file ``.sweep-output``
  (``REPORT_MARKER``). A target that exists is replaced only when it carries
  the mark of the same kind, or is an empty folder (nothing is lost);
  anything else is refused (``OutputError``, one line) before any work, as
  are a target that is a file or a link, the current folder (``out=.``) and a
  folder that cannot be written. The identity matters because xarray copies a
  cube's attributes into whatever a user derives from it and saves: such a
  store is the user's, not the tool's. A store the user moves keeps its
  inode and stays the tool's; a copy does not.
* **One writer per target.** ``<target>.lock`` is held with ``flock`` while
  the target is written, and records the writer's PID, host, start time and
  the job's fingerprint for the message a second writer gets. The kernel
  drops a ``flock`` when its process ends, however it ends, so the lock of a
  killed run is taken over by the next run without anyone deleting it. The
  shards of one sweep (``sweep-grid shard=K/N``) hold it together, shared,
  after checking that the first one recorded the same fingerprint; a writer
  of anything else is refused while they do.
* **Old or new.** An old target is renamed to ``<target>.old`` before the new
  one is renamed into place, and removed after. A kill in between leaves the
  old output under ``.old`` and the new one complete under its temporary name;
  the next run of the command removes the ``.old`` (a sweep also installs the
  finished cube it finds; a report or optimize dataset is written anew).

Under Hydra's multirun (``-m``), jobs naming one output each claim it in the
multirun's folder (``claim``): the second job naming it is refused instead of
replacing the first job's result.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from pathlib import Path

from sweep.errors import ConfigError

MARKER = "sweep_output"
"""The root attribute that marks a zarr store the tool wrote: ``"<kind> <inode>"``."""

REPORT_MARKER = ".sweep-output"
"""The file that marks a report folder the tool wrote (same content)."""

KINDS = {"cube": "sweep-grid cube", "optimize": "sweep-optimize dataset",
         "report": "sweep-report report"}
"""Each kind of output, as messages name it."""


class OutputError(ConfigError):
    """An output path the tool must not write: one line for the user."""


def write_whole(path: Path, data: bytes | bytearray | str) -> None:
    """Writes ``data`` to ``path`` whole or not at all: into a temporary file
    beside it, renamed over it (a kill leaves the old file or the new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w" if isinstance(data, str) else "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def mark(folder: Path, kind: str) -> None:
    """Marks ``folder`` (a zarr v2 store, or a report folder) as the tool's
    output of ``kind``; it keeps the mark when renamed or moved, not when copied."""
    value = f"{kind} {os.stat(folder).st_ino}"
    if kind == "report":
        (folder / REPORT_MARKER).write_text(value + "\n")
        return
    import zarr

    zarr.open_group(str(folder), mode="r+", zarr_format=2).attrs[MARKER] = value


def kind_of(path: Path) -> str | None:
    """The kind of output the tool wrote at ``path``; None if it wrote none."""
    try:
        if (path / REPORT_MARKER).is_file():
            value = (path / REPORT_MARKER).read_text().strip()
        else:
            value = json.loads((path / ".zattrs").read_text()).get(MARKER, "")
        kind, _, inode = str(value).partition(" ")
        return kind if inode == str(os.stat(path).st_ino) else None
    except (OSError, ValueError, AttributeError):
        return None


def _ours(path: Path, kind: str) -> bool:
    """Whether replacing ``path`` loses nothing the tool did not write."""
    return (path.is_dir() and not path.is_symlink()
            and (kind_of(path) == kind or not any(path.iterdir())))


def _writable_folder(path: Path) -> Path:
    """The nearest existing folder at or above ``path`` (what ``mkdir -p`` needs)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path.cwd()


def check_target(path: Path, label: str, kind: str = "cube") -> None:
    """Refuses a target the tool must not write, before any work.

    Args:
      path: the output (a zarr store or a folder), as the user named it.
      label: how the user named it (``out=x.zarr``, ``--out rep``), for the message.
      kind: the kind of output to write there (``KINDS``).

    Raises:
      OutputError: one line naming ``label`` and what is allowed.
    """
    what = KINDS[kind]
    allowed = f"allowed: a new path, an empty folder or an earlier {what}"
    p = Path(path).expanduser()
    here = Path.cwd().resolve()
    if p.resolve() == here or p.resolve() in here.parents:
        raise OutputError(f"{label}: is the current folder or holds it; allowed: "
                          "a path to a new output")
    if p.is_symlink():
        raise OutputError(f"{label}: is a link; name the output itself")
    if p.exists():
        if not p.is_dir():
            raise OutputError(f"{label}: exists and is not a folder; {allowed}")
        if not _ours(p, kind):
            other = kind_of(p)
            why = (f"it is a {KINDS[other]}" if other in KINDS
                   else "it does not carry the tool's mark")
            raise OutputError(f"{label}: exists and is not a {what} ({why}); it is "
                              f"left as it is; {allowed}")
    folder = _writable_folder(p.parent)
    if not folder.is_dir():
        raise OutputError(f"{label}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
    except OSError as e:
        raise OutputError(f"{label}: cannot write in {folder} "
                          f"({e.strerror or type(e).__name__}); allowed: a "
                          "writable folder") from None
    os.close(fd)
    os.unlink(probe)


def remove(path: Path, kind: str = "cube") -> None:
    """Removes the tool's own output of ``kind`` at ``path``; refuses anything else."""
    if not (path.exists() or path.is_symlink()):
        return
    if not _ours(path, kind):
        raise OutputError(f"{path}: exists and is not a {KINDS[kind]}; it is left "
                          "as it is; move it away and rerun")
    shutil.rmtree(path)


def install_steps(staged: Path, target: Path, kind: str = "cube"
                  ) -> list[Callable[[], None]]:
    """``install``'s steps, in order (a test can stop after any, as a kill would).

    The old target goes to ``<target>.old`` before the new one is renamed into
    place and is removed after; a leftover ``.old`` (a kill's) is removed first.
    """
    aside = target.with_name(target.name + ".old")

    def clear_aside() -> None:
        remove(aside, kind)

    def set_aside() -> None:
        if not (target.exists() or target.is_symlink()):
            return
        if not _ours(target, kind):
            raise OutputError(f"{target}: appeared while the output was written and "
                              f"is not a {KINDS[kind]}; it is left as it is; the new "
                              f"output is in {staged}")
        os.replace(target, aside)

    def put() -> None:
        os.replace(staged, target)

    return [clear_aside, set_aside, put, clear_aside]


def install(staged: Path, target: Path, kind: str = "cube") -> None:
    """Moves the complete, marked ``staged`` folder to ``target``, replacing the
    old output of the same kind: a kill leaves the old output (at its name or
    under ``<target>.old``) or the new one."""
    for step in install_steps(staged, target, kind):
        step()


@contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A new hidden folder beside ``target`` to build the output in; removed on
    the way out unless it was installed (``install``) meanwhile."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def lock_path(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


def _holder(fd: int) -> str:
    """Who holds a lock, from what its file records."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        shards = " and other shards" if info.get("shards") else ""
        return (f"pid {info['pid']}{shards} on {info['host']} since "
                f"{info['started_utc']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


_held: dict[str, int] = {}  # lock file -> descriptor, of the locks this process holds


def _open_locked(path: Path, how: int) -> int:
    """A descriptor of ``path`` (created if absent) holding ``flock(how)``.

    Raises:
      BlockingIOError: ``how`` is non-blocking and another process holds a
        conflicting lock (the descriptor is closed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how)
        except OSError:
            os.close(fd)
            raise
        # the previous holder may have removed the file between open and flock
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _release(path: Path, fd: int) -> None:
    """Removes ``path`` while still holding it (an opener waiting on it
    retries), then closes it."""
    with suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


def _busy(e: OSError) -> bool:
    return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _refused(target: Path, path: Path, who: str) -> OutputError:
    return OutputError(f"{target}: being written by {who} (lock {path}); wait for "
                       "it to end, or choose another output")


@contextmanager
def serial(target: Path) -> Iterator[None]:
    """Holds ``<target>.shards.lock`` (waiting for it): the shards of one
    sweep join, create the store, finish and leave one at a time."""
    target = Path(target)
    path = target.with_name(target.name + ".shards.lock")
    fd = _open_locked(path, fcntl.LOCK_EX)
    try:
        yield
    finally:
        _release(path, fd)


def _record(fd: int, fingerprint: str, shared: bool) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": fingerprint, **({"shards": True} if shared else {})}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


def _fingerprint_of(fd: int) -> str | None:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}").get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _join(target: Path, path: Path, fingerprint: str) -> int:
    """Takes ``path`` shared, as a shard of the sweep ``fingerprint``."""
    with serial(target):
        try:
            fd = _open_locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not _busy(e):
                raise
        else:  # the first shard: it records the sweep, then shares the lock
            _record(fd, fingerprint, True)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return fd
            except OSError as e:  # another writer took it in between
                who = _holder(fd)
                os.close(fd)
                if not _busy(e):
                    raise
                raise _refused(target, path, who) from None
        try:
            fd = _open_locked(path, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:  # a writer of the whole output holds it
            if not _busy(e):
                raise
            fd = os.open(path, os.O_RDONLY)
            who = _holder(fd)
            os.close(fd)
            raise _refused(target, path, who) from None
        if _fingerprint_of(fd) != fingerprint:
            who = _holder(fd)
            os.close(fd)
            raise _refused(target, path, f"the shards of another sweep ({who})")
        return fd


def _leave(target: Path, path: Path, fd: int) -> None:
    """Drops a shard's share; the last shard removes the lock file."""
    with serial(target):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # other shards still hold it
            os.close(fd)
            return
        _release(path, fd)


@contextmanager
def lock(target: Path, fingerprint: str = "", *, shared: bool = False
         ) -> Iterator[None]:
    """Holds ``<target>.lock`` while the body writes ``target``.

    Reentrant: within a process that holds it already (a command around the
    library call that writes), it is a no-op.

    Args:
      shared: held by a shard of the sweep ``fingerprint``: the shards of
        one sweep hold it together (``flock`` shared); a writer of another
        sweep, or a writer of the whole output, is refused while they do.

    Raises:
      OutputError: another live process holds it (one line naming it).
    """
    target = Path(target)
    path = lock_path(target)
    key = str(path.absolute())
    if key in _held:
        yield
        return
    if shared:
        fd = _join(target, path, fingerprint)
    else:
        try:
            fd = _open_locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not _busy(e):
                raise OutputError(f"{target}: cannot lock {path} ({e.strerror})"
                                  ) from None
            fd = os.open(path, os.O_RDONLY)
            who = _holder(fd)
            os.close(fd)
            raise _refused(target, path, who) from None
        _record(fd, fingerprint, False)
    _held[key] = fd
    try:
        yield
    finally:
        del _held[key]
        if shared:
            _leave(target, path, fd)
        else:
            _release(path, fd)


def claim(target: Path, folder: Path, job: int, label: str,
          sweep: str | None = None) -> None:
    """Claims ``target`` for job ``job`` of a multirun whose folder is ``folder``.

    Args:
      sweep: the fingerprint of the sweep when the job is one of its shards:
        the other shards of the same sweep may write ``target`` too.

    Raises:
      OutputError: another job of the same multirun claimed it.
    """
    key = hashlib.sha256(str(Path(target).resolve()).encode()).hexdigest()[:16]
    path = Path(folder) / f".claim-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole under a name of this process's own, then linked into place:
    # the link fails if the claim exists, and a job reading a claim never
    # sees it half written (an empty claim read as another job's refused
    # shards of one sweep started together)
    mine = path.with_name(f"{path.name}.{job}.{os.getpid()}")
    mine.write_text(json.dumps({"job": job, "out": str(target), "sweep": sweep}))
    try:
        os.link(mine, path)
    except FileExistsError:
        claimed = json.loads(path.read_text())
        other = claimed.get("job")
        if other == job or (sweep is not None and claimed.get("sweep") == sweep):
            return
        who = "another job" if other is None else f"job {other}"
        raise OutputError(
            f"{label}: {who} of this multirun writes it already; give each "
            "job its own output, e.g. out='cube_${hydra:job.num}.zarr', or split "
            "one sweep over the jobs with shard=K/N") from None
    finally:
        mine.unlink()
