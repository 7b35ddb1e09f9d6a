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
  killed run is taken over by the next run without anyone deleting it. (Shards
  of one sweep writing one store would each take a lock of their own and
  check that the others record the same fingerprint.)
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
            raise OutputError(f"{label}: exists and is not a {what} (it does not "
                              f"carry the tool's mark); it is left as it is; "
                              f"{allowed}")
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
        return (f"pid {info['pid']} on {info['host']} since {info['started_utc']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


_held: dict[str, int] = {}  # lock file -> descriptor, of the locks this process holds


@contextmanager
def lock(target: Path, fingerprint: str = "") -> Iterator[None]:
    """Holds ``<target>.lock`` while the body writes ``target``.

    Reentrant: within a process that holds it already (a command around the
    library call that writes), it is a no-op.

    Raises:
      OutputError: another live process holds it (one line naming it).
    """
    path = lock_path(Path(target))
    key = str(path.absolute())
    if key in _held:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            who = _holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputError(f"{target}: cannot lock {path} ({e.strerror})"
                                  ) from None
            raise OutputError(f"{target}: being written by {who} (lock {path}); "
                              "wait for it to end, or choose another output"
                              ) from None
        # the previous holder may have removed the file between open and flock
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": fingerprint}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _held[key] = fd
    try:
        yield
    finally:
        del _held[key]
        with suppress(FileNotFoundError):
            os.unlink(path)  # while still held: an opener waiting on it retries
        os.close(fd)


def claim(target: Path, folder: Path, job: int, label: str) -> None:
    """Claims ``target`` for job ``job`` of a multirun whose folder is ``folder``.

    Raises:
      OutputError: another job of the same multirun claimed it.
    """
    key = hashlib.sha256(str(Path(target).resolve()).encode()).hexdigest()[:16]
    path = Path(folder) / f".claim-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        other = json.loads(path.read_text() or "{}").get("job")
        if other == job:
            return
        who = "another job" if other is None else f"job {other}"
        raise OutputError(
            f"{label}: {who} of this multirun writes it already; give each "
            "job its own output, e.g. out='cube_${hydra:job.num}.zarr'") from None
    with os.fdopen(fd, "w") as f:
        json.dump({"job": job, "out": str(target)}, f)
