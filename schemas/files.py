"""Reading and writing cpplan files, the one place that touches paths (docs/failures.md).

Reading (:func:`read_input`): regular files only. The path is opened non-blocking (a FIFO then
neither hangs the open nor the read), checked with ``fstat`` before any byte is read, and at
most ``max_bytes + 1`` bytes are read, so ``/dev/zero`` or a 300 MB file is refused without
being loaded. Every failure is an :class:`InputFileError` naming the path.

Writing (:func:`write_atomic`): all or nothing (a temp file in the same folder, then a rename),
so an error or an interrupt never leaves a half-written file. Only a regular file or a new path
is replaced: a symlink, device, FIFO or folder at the target is refused (as root, ``-o
/dev/null`` would otherwise replace the system's), and so is one of the caller's own inputs
(``cpplan plan s.json -o s.json`` would replace the step with its plan). A replaced file keeps
its permission bits; being a rename, the replace does not keep a hard link to the old file (the
other names keep the old bytes). Every failure is an :class:`OutputError` naming the target.

A path is a str, bytes or ``os.PathLike``; anything else, or a path holding a NUL byte, is the
same typed error, never os's ``TypeError`` / ``ValueError``.

Parsing JSON that is not a cpplan file (a prompts line, a checkpoint's config.json):
:func:`loads_json` refuses what the standard library would accept silently or fail on with a
traceback, a key given twice in one object (last wins) and nesting past the interpreter's
recursion limit (``RecursionError``), as one-line ``ValueError`` s.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

from cpplan.schemas.errors import InputFileError, OutputError

MAX_INPUT_BYTES = 256 * 2**20  # the codec's MAX_FILE_BYTES: no cpplan input is larger
_READ_CHUNK = 1 << 20
_TMP_PREFIX_BYTES = 64  # of the target's name in the temp file's: ".NAME.XXXXXXXX" fits NAME_MAX

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _oserror_words(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, type(exc).__name__)


def _path_name(path, error: type[Exception], verb: str) -> str:
    """``path`` as a str (bytes decoded as the file system does), else ``error``: a wrong type,
    or a NUL byte (no file name holds one), is one line here rather than os's TypeError or
    ValueError."""
    try:
        name = os.fsdecode(path)
    except TypeError:
        raise error(f"cannot {verb}: expected a file path (str, bytes or os.PathLike): got "
                    f"{type(path).__name__}") from None
    if "\x00" in name:
        raise error(f"cannot {verb} {name[:200]!r}: a file path cannot hold a NUL byte")
    return name


def read_input(path: str | os.PathLike, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (at most ``max_bytes``), else InputFileError."""
    name = _path_name(path, InputFileError, "read")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags)
    except OSError as exc:
        raise InputFileError(f"cannot read {name}: {_oserror_words(exc)}") from None
    try:
        _check_regular(name, os.fstat(fd), max_bytes)
        return _read_capped(fd, name, max_bytes)
    except OSError as exc:
        raise InputFileError(f"cannot read {name}: {_oserror_words(exc)}") from None
    finally:
        os.close(fd)


def check_input_file(path: str | os.PathLike, max_bytes: int = MAX_INPUT_BYTES) -> int:
    """The size of the regular file ``path`` (at most ``max_bytes``), else InputFileError: for
    a file another library opens (a checkpoint's weights, a tokenizer), which would block on a
    FIFO or read a device without end. Follows symlinks, as that library's open would."""
    name = _path_name(path, InputFileError, "read")
    try:
        info = os.stat(name)
    except OSError as exc:
        raise InputFileError(f"cannot read {name}: {_oserror_words(exc)}") from None
    _check_regular(name, info, max_bytes)
    return info.st_size


def _check_regular(name: str, info: os.stat_result, max_bytes: int) -> None:
    """InputFileError unless ``info`` is a regular file of at most ``max_bytes``."""
    if not stat.S_ISREG(info.st_mode):
        raise InputFileError(
            f"cannot read {name}: it is {_kind(info.st_mode)}; expected a regular file")
    if info.st_size > max_bytes:
        raise InputFileError(f"{name}: file too large: got {info.st_size:,} bytes, "
                             f"limit {max_bytes:,}")


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicates(pairs):
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(f"key {key!r} given twice in one object")
            seen.add(key)
    return obj


def loads_json(text: str | bytes):
    """``json.loads(text)``, but a key given twice in one object, or nesting deeper than the
    recursion limit, is a one-line ValueError (not the last value silently, nor a
    RecursionError traceback)."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicates)
    except RecursionError:
        raise ValueError("nested too deeply: expected at most a few hundred levels of "
                         "arrays and objects") from None


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


def check_output_target(path: str | os.PathLike, inputs=()) -> Path:
    """Refuse an output path that is not a regular file or a new path, whose folder is missing,
    or that is the same file as one of ``inputs`` (the caller's input paths); returns it as a
    Path."""
    name = _path_name(path, OutputError, "write")
    target = Path(name)
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
    if info is not None:
        _refuse_an_input(name, inputs)
    return target


def _refuse_an_input(name: str, inputs) -> None:
    """OutputError when the existing file ``name`` is one of ``inputs`` (same inode: a hard
    link or another spelling of the path counts)."""
    for item in inputs:
        try:
            same = item is not None and os.path.samefile(name, item)
        except (OSError, ValueError, TypeError):
            continue  # a missing or unusable input is reported when it is read
        if same:
            other = os.fsdecode(item)
            what = "" if os.path.abspath(other) == os.path.abspath(name) else f" ({other})"
            raise OutputError(f"refusing to replace {name}: it is an input of this command"
                              f"{what}; write the output to another path")


def _tmp_prefix(target: Path) -> str:
    """``.NAME.`` with NAME the target's name cut to _TMP_PREFIX_BYTES encoded bytes (a cut by
    characters let a 252-byte name of 4-byte characters give a temp name over NAME_MAX); the
    cut drops a partial character, so the prefix stays valid UTF-8."""
    head = os.fsencode(target.name)[:_TMP_PREFIX_BYTES]
    return f".{head.decode('utf-8', 'ignore')}."


def _mode_for(target: Path) -> int:
    """The permission bits of the file being replaced, else what open() gives a new file."""
    try:
        info = os.stat(target)
    except OSError:
        return 0o666 & ~_UMASK
    return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else 0o666 & ~_UMASK


def write_atomic(path: str | os.PathLike, data: bytes, *, inputs=()) -> None:
    """Write ``data`` to ``path`` all or nothing; OutputError (naming ``path``) on failure. An
    existing file at ``path`` keeps its permission bits (not its hard links: the write is a
    rename over it); one that is the same file as one of ``inputs`` is refused."""
    target = check_output_target(path, inputs)
    name = os.fsdecode(path)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise OutputError(f"cannot write {name}: expected bytes: got {type(data).__name__}")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(target), dir=target.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, _mode_for(target))
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
