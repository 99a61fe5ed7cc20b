"""Outputs that never lose a file: checked before the run, written to a temporary name and
renamed, an existing file replaced only when the user said so.

    check_outputs({"--log": "run.jsonl"}, inputs={"--trace": "t.jsonl"}, overwrite=False)
    atomic_write("sim.json", text, overwrite=True)          # whole files: JSON, plots
    with LineFile("run.jsonl", mode="new") as f: f.write_line(json_text)   # logs, traces

The rules, for every command that writes (train, simulate, and the library under them):

- An output is refused before anything runs when it is a folder, when its folder does not
  exist or cannot be written, when it is the same file as an input or as another output,
  when it exists and the user did not say `--overwrite` (or, for a run's log, `--resume`,
  which appends), or when its disk is full (an existing device such as /dev/full is
  probed with an empty write). These are UsageErrors: one line, exit 2.
- A whole file (JSON, a plot, a checkpoint, a manifest) is written to `.NAME.tmp-PID` in
  the same folder, flushed, fsynced, then renamed over NAME: a reader sees the old file or
  the new one, never half of one.
- A line-by-line file (the JSONL step log, a routing trace) must be readable while the
  run goes and after it dies, so it lives at its own name: a new file is created
  exclusively (O_EXCL: a file that appeared since the check is not clobbered), `append`
  adds complete lines to the end of an existing one (never truncated), and `overwrite`
  writes the new file under the temporary name, created with its first line, and renames
  it over the old one only when the run closes it at a normal end, having written
  something. A run that fails, is interrupted or killed, at any point, leaves the old file
  whole: one that dies before its first line (a start-up error, an out-of-memory in the
  first step, Ctrl-C during the model build) leaves no temporary file either; one that
  fails later has its temporary file removed (SIGKILL leaves it: `.NAME.tmp-PID`). That is
  the choice between the two promises: the old file whole, or the new run's lines kept;
  the cost is that a run that failed under `--overwrite` leaves no log of its own steps
  (give it a new `--log` to keep one, or `--resume` to append).
- An existing output that `--overwrite` will replace is checked to be replaceable before
  the run (its folder writable, the file not immutable or append-only, not someone
  else's in a sticky folder): a run must not train for an hour and then fail to land.
- An output path that ends in `/` names a folder, even one that does not exist yet: it
  is refused, not written as a file named like the folder.
- A write that fails once work began (ENOSPC, EIO) is an OutputError (exit 3): the
  partial line is cut off, a temporary file is removed, and the previous file is intact.

Existing files that are not regular files (/dev/null, a terminal, a pipe) are written in
place: they hold nothing to lose.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

from spikeguard.errors import OutputError, UsageError

PathLike = Union[str, os.PathLike]
MODES = ("new", "append", "overwrite")


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether two paths name one file (the same path, a symlink or hard link to it)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _is_special(path: Path) -> bool:
    try:
        return not stat.S_ISREG(path.stat().st_mode) and not path.is_dir()
    except OSError:
        return False


def _check_not_a_folder_name(what: str, path: PathLike) -> None:
    """pathlib drops a trailing '/': `newdir/` would be written as a file `newdir`."""
    if str(path).endswith(("/", os.sep)):
        raise UsageError(f"{what} {path} names a folder (it ends in '/'); give a file name")


def check_output(what: str, path: PathLike, *, overwrite: bool = False,
                 append: bool = False) -> Path:
    """UsageError unless `path` can be written by this run (see the module docstring)."""
    _check_not_a_folder_name(what, path)
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{what} {p} is a folder; give a file name")
    folder = p.parent
    if not folder.is_dir():
        raise UsageError(f"{what} {p}: folder {folder} does not exist")
    if _is_special(p):
        try:   # an empty write reports what a real one would (/dev/full: ENOSPC)
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"")
            finally:
                os.close(fd)
        except OSError as exc:
            raise UsageError(f"cannot write {what} {p}: {_why(exc)}") from None
        return p
    if p.exists() and not (overwrite or append):
        raise UsageError(f"{what} {p} exists; pass --overwrite to replace it")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write {what} {p}: folder {folder} is not writable")
    if overwrite and not append and p.exists():
        check_replaceable(what, p)
    try:
        if os.statvfs(folder).f_bavail == 0:
            raise UsageError(f"cannot write {what} {p}: no space left on its device")
    except OSError:
        pass
    return p


# Linux inode flags (linux/fs.h): FS_IOC_GETFLAGS = _IOR('f', 1, long); the kernel reads
# and writes an int. A rename over an immutable or append-only file fails with EPERM.
_FS_IOC_GETFLAGS, _FS_IMMUTABLE_FL, _FS_APPEND_FL = 0x80086601, 0x10, 0x20


def _inode_flags(path: Path) -> int:
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (ImportError, OSError):
        return 0
    try:
        buf = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf, True)
        return int.from_bytes(buf[:4], sys.byteorder)
    except OSError:   # a file system without inode flags
        return 0
    finally:
        os.close(fd)


def check_replaceable(what: str, path: PathLike) -> None:
    """UsageError unless the existing regular file `path` can be renamed over (what
    --overwrite does when the new file lands): checked before the run, not after it."""
    p = Path(path)
    if _is_special(p):
        return
    folder = p.parent
    if not os.access(folder, os.W_OK):
        raise UsageError(f"cannot replace {what} {p}: folder {folder} is not writable")
    flags = _inode_flags(p)
    if flags & (_FS_IMMUTABLE_FL | _FS_APPEND_FL):
        kind = "immutable" if flags & _FS_IMMUTABLE_FL else "append-only"
        raise UsageError(f"cannot replace {what} {p}: the file is {kind} (chattr -i/-a "
                         f"to allow it)")
    try:
        st, folder_st = p.stat(), folder.stat()
    except OSError:
        return
    me = os.geteuid()
    if folder_st.st_mode & stat.S_ISVTX and me not in (0, st.st_uid, folder_st.st_uid):
        raise UsageError(f"cannot replace {what} {p}: it is another user's, in a folder "
                         f"where only the owner may replace a file (sticky bit)")


def check_outputs(outputs: Mapping[str, Iterable[PathLike] | PathLike | None], *,
                  inputs: Mapping[str, Iterable[PathLike] | PathLike | None] = {},
                  overwrite: bool = False, append: Iterable[str] = ()) -> None:
    """Every output checked, none the same file as an input or another output.
    `append`: the names of outputs an existing file of which is appended to."""
    def pairs(table):
        for name, value in table.items():
            if value is None:
                continue
            values = [value] if isinstance(value, (str, os.PathLike)) else list(value)
            for v in values:
                if table is outputs:
                    _check_not_a_folder_name(name, v)
                yield name, Path(v)

    outs, ins = list(pairs(outputs)), list(pairs(inputs))
    append = set(append)
    for i, (name, path) in enumerate(outs):
        for in_name, in_path in ins:
            inside = in_path.is_dir() and Path(os.path.realpath(path)).is_relative_to(
                os.path.realpath(in_path))
            if same_file(path, in_path) or inside:
                raise UsageError(f"{name} {path} would overwrite the {in_name} {in_path} it "
                                 f"reads; write it elsewhere")
        for other_name, other in outs[:i]:
            if same_file(path, other) and not _is_special(path):
                raise UsageError(f"{name} and {other_name} are the same file {path}; give "
                                 f"each its own")
        check_output(name, path, overwrite=overwrite, append=name in append)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: PathLike, data: Union[bytes, str, None] = None, *, overwrite: bool,
                 writer=None, what: str = "output") -> Path:
    """Write `data` (or call `writer(temp_path)`) to a temporary name beside `path`,
    fsync, rename over `path`. An existing `path` is replaced only with `overwrite`; on
    any failure the temporary file is removed and `path` is as it was (OutputError)."""
    p = Path(path)
    if _is_special(p):
        with open(p, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data if data is not None else "")
        return p
    if p.exists() and not overwrite:
        raise UsageError(f"{what} {p} exists; pass --overwrite to replace it")
    tmp = _temp_name(p)
    try:
        if writer is not None:
            writer(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {what} {p}: {_why(exc)}; the previous file is "
                          f"unchanged") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(p.parent)
    return p


class LineFile:
    """A text file written line by line, each line flushed (see the module docstring for
    `mode`: new, append, overwrite). `close()` (or a `with` block left normally) ends it;
    `abort()` (a `with` block left by an exception) ends it without replacing anything."""

    def __init__(self, path: PathLike, mode: str = "new", what: str = "output"):
        assert mode in MODES, mode
        self.path, self.what = Path(path), what
        self._tmp: Optional[Path] = None
        self._fd: Optional[int] = None
        self._closed = self._replacing = False
        special = _is_special(self.path)
        try:
            if special:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            elif mode == "append":
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            elif mode == "overwrite" and self.path.exists():
                check_replaceable(what, self.path)
                self._tmp = _temp_name(self.path)   # created with the first line
            else:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            raise UsageError(f"{what} {self.path} exists; pass --overwrite to replace "
                             f"it") from None
        except OSError as exc:
            raise UsageError(f"cannot open {what} {self.path}: {_why(exc)}") from None
        self._seekable = not special
        if self._seekable and mode == "append":
            self._cut_partial_line()

    def _cut_partial_line(self) -> None:
        """A run that died mid-line left half a record: appended lines start clean."""
        size = os.fstat(self._fd).st_size
        if not size:
            return
        with open(self.path, "rb") as f:
            data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep != size:
            os.ftruncate(self._fd, keep)

    def _failed(self, exc: OSError) -> OutputError:
        self.abort()
        what = "disk full" if exc.errno == errno.ENOSPC else _why(exc)
        kept = "; the previous file is unchanged" if self._replacing else ""
        return OutputError(f"cannot write {self.what} {self.path}: {what}{kept}")

    def write_line(self, text: str) -> None:
        assert not self._closed, "write_line after close"
        data = (text.rstrip("\n") + "\n").encode("utf-8")
        self._replacing = self._tmp is not None
        start = None
        try:
            if self._fd is None:   # an overwrite's first line: the temporary file begins
                self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            start = os.lseek(self._fd, 0, os.SEEK_END) if self._seekable else None
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            if start is not None and self._tmp is None:
                try:
                    os.ftruncate(self._fd, start)   # no half line left behind
                except OSError:
                    pass
            raise self._failed(exc) from None

    def abort(self) -> None:
        """End without replacing anything: a temporary file is removed, an old file
        that an overwrite would have replaced stays whole."""
        self._closed = True
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    def close(self) -> None:
        """The normal end: an overwrite that wrote something lands over the old file."""
        if self._closed:
            return
        if self._fd is None:   # an overwrite that wrote nothing: the old file stands
            self._closed, self._tmp = True, None
            return
        if self._seekable:
            try:
                os.fsync(self._fd)
            except OSError:
                pass
        if self._tmp is not None:
            try:
                os.replace(self._tmp, self.path)
            except OSError as exc:
                self._replacing = True
                raise self._failed(exc) from None
        self._closed = True
        os.close(self._fd)
        self._fd = None
        if self._tmp is not None:
            self._tmp = None
            _fsync_folder(self.path.parent)

    def __enter__(self) -> "LineFile":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
