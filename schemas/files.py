"""Reading and writing cpplan files, the one place that touches paths (docs/design.md §Failure
behaviour).

Reading (:func:`read_input`): regular files only. The path is opened non-blocking (a FIFO then
neither hangs the open nor the read), checked with ``fstat`` before any byte is read, and at
most ``max_bytes + 1`` bytes are read, so ``/dev/zero`` or a 300 MB file is refused without
being loaded. Every failure is an :class:`InputFileError` naming the path.

Writing (:func:`write_atomic`): all or nothing (a temp file in the same folder, then a rename),
so an error or an interrupt never leaves a half-written file. Only a regular file or a new path
is replaced: a symlink, device, FIFO or folder at the target is refused (as root, ``-o
/dev/null`` would otherwise replace the system's). Every failure is an :class:`OutputError`
naming the target.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from cpplan.schemas.errors import InputFileError, OutputError

MAX_INPUT_BYTES = 256 * 2**20  # the codec's MAX_FILE_BYTES: no cpplan input is larger
_READ_CHUNK = 1 << 20

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _oserror_words(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, type(exc).__name__)


def read_input(path: str | os.PathLike, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (at most ``max_bytes``), else InputFileError."""
    name = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags)
    except OSError as exc:
        raise InputFileError(f"cannot read {name}: {_oserror_words(exc)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputFileError(
                f"cannot read {name}: it is {_kind(info.st_mode)}; expected a regular file")
        if info.st_size > max_bytes:
            raise InputFileError(f"{name}: file too large: got {info.st_size:,} bytes, "
                                 f"limit {max_bytes:,}")
        return _read_capped(fd, name, max_bytes)
    except OSError as exc:
        raise InputFileError(f"cannot read {name}: {_oserror_words(exc)}") from None
    finally:
        os.close(fd)


def _read_capped(fd: int, name: str, max_bytes: int) -> bytes:
    """Read to EOF but never more than max_bytes + 1 bytes (a file growing while read, or a
    special file claiming size 0, cannot make this allocate more)."""
    parts, total = [], 0
    while total <= max_bytes:
        chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    if total > max_bytes:
        raise InputFileError(f"{name}: file too large: more than {max_bytes:,} bytes")
    return b"".join(parts)


def check_output_target(path: str | os.PathLike) -> Path:
    """Refuse an output path that is not a regular file or a new path, or whose folder is
    missing; returns it as a Path."""
    target = Path(path)
    name = os.fspath(path)
    if not name or name.endswith(os.sep):
        raise OutputError(f"cannot write {name!r}: expected a file path")
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise OutputError(f"cannot write {name}: {_oserror_words(exc)}") from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise OutputError(f"refusing to replace {name}: it is {_kind(info.st_mode)}; expected "
                          f"a regular file or a new path")
    parent = target.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {name}: folder {os.fspath(parent)} does not exist")
    return target


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` all or nothing; OutputError (naming ``path``) on failure."""
    target = check_output_target(path)
    name = os.fspath(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:64]}.", dir=target.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o666 & ~_UMASK)  # what open() would have given a new file
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise OutputError(f"cannot write {name}: {_oserror_words(exc)}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # once, at import: os.umask is process-wide, not thread-safe
