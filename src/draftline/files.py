"""Writing the run's files so that a full disk is named and leaves nothing half-written that looks whole.

Two ways to write, one for each kind of file:

- ``append_line``: one record (a JSON line of ``metrics.jsonl``, of the trace) goes on whole or not at
  all: where the disk fills in the middle of it, the part written is cut off again, so the file still
  ends with its last whole record;
- ``write_atomic``: a whole file (``summary.md``, a plot) goes to a temporary file beside it that is
  renamed over it once complete; where the write fails the temporary file is removed, and a file of that
  name from before stays as it was.

A full disk (ENOSPC, or a quota: EDQUOT) becomes a ``MachineError`` in the style of a checkpoint's
(``checkpoint.state``): what could not be written, the free bytes on that file system, what was kept,
and the fix. Any other OSError is raised as it is.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from draftline.errors import MachineError

FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full_error(exc: BaseException, path: str | Path, what: str, kept: str, fix: str) -> MachineError | None:
    """The ``MachineError`` for a full disk behind ``exc`` (its causes searched too), or None."""
    found = _full_disk(exc)
    if found is None:
        return None
    path = Path(path)
    folder = next((p for p in (path.parent, *path.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(folder).free
    return MachineError(f"could not write {what} {path}: the disk is full ({os.strerror(found.errno)}): "
                        f"{_bytes(free)} free on {folder}; {kept}; {fix}")


def _full_disk(exc: BaseException | None) -> OSError | None:
    for _ in range(8):
        if exc is None:
            return None
        found = os_error_of(exc)
        if found is not None and found.errno in FULL:
            return found
        exc = exc.__cause__ or exc.__context__
    return None


def os_error_of(exc: BaseException) -> OSError | None:
    """``exc`` itself where it is an OSError, or the OSError a Rust library's error carries in its message
    (safetensors raises ``SafetensorError('... I/O error: No space left on device (os error 28)')``)."""
    if isinstance(exc, OSError):
        return exc
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def append_line(fd: int, line: str, path: str | Path, what: str, fix: str) -> None:
    """Append ``line`` (ending in a newline) to the file open as ``fd`` (``O_APPEND``), whole or not at all."""
    data = memoryview(line.encode("utf-8"))
    size = os.fstat(fd).st_size
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as exc:
        try:
            os.ftruncate(fd, size)  # the part of the record that was written goes: the file ends whole
        except OSError:
            pass
        error = disk_full_error(exc, path, what, "the records before this one are whole; this one was not kept", fix)
        if error is None:
            raise
        raise error from exc


def open_for_append(path: str | Path) -> int:
    """A file descriptor that appends to ``path`` (created if missing), for ``append_line``."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def write_atomic(path: str | Path, data: bytes, what: str, fix: str) -> Path:
    """Write ``data`` to ``path`` through a temporary file renamed over it: whole or not at all."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        kept = f"the {path.name} from before is as it was" if path.exists() else "nothing of it was kept"
        error = disk_full_error(exc, path, what, kept, fix)
        if error is None:
            raise
        raise error from exc
    return path


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
