"""Append-only files of complete lines (the ledger, metrics.jsonl, eval.jsonl) that a full disk cannot tear.

Each line goes straight to an O_APPEND descriptor (os.write, repeated only when a full disk takes part of it):
no Python buffer keeps a line that failed and hands it to the disk later (a later flush would write a line
whose effect nothing recorded). A line the disk refuses, even in part, is cut off at once, and the file takes
no line after it (`failed`), so the file only ever holds complete lines in the order they were accepted. An
incomplete last line left by a crash is cut off when the file is opened.

Before each line and each sync the file is checked to be where it was: its path must still lead to the open
file (the same st_dev and st_ino) and the file must end where this writer left it. A file deleted, replaced
(another file renamed or copied to its path) or cut or written to by another program takes no more lines
(FileMoved, an OSError): writing on would put lines where nobody reads them, or after lines that are gone.
Nothing written is lost: a deleted file's lines are written back at its path, a replaced one's beside it.
Pure Python.
"""

from __future__ import annotations

import errno
import os
import pathlib

_TAIL_READ = 65536  # bytes read back at a time when looking for the last complete line
NEWLINE = b"\n"


def _write_all(fd: int, data: bytes) -> None:
    written = 0
    while written < len(data):
        written += os.write(fd, data[written:])
    os.fsync(fd)


class FileMoved(OSError):
    """The path no longer leads to the file being written, or the file no longer ends where its writer left it.
    `strerror` says what happened and where the lines are now; `remedy` what to do about it."""

    def __init__(self, path: pathlib.Path, what: str, remedy: str):
        super().__init__(errno.ESTALE, what, str(path))
        self.remedy = remedy


class LineFile:
    """Appends lines to `path` (created if missing). `append` raises the OSError of a failed write after
    cutting the file back; every later `append`/`sync` then raises it again."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self.failed: OSError | None = None  # the first write or sync that failed
        self.length = self._cut_torn_tail()  # bytes of complete lines

    def _cut_torn_tail(self) -> int:
        """Cut an incomplete last line off (a crash mid-write): appended to, it would swallow the next line."""
        size = os.fstat(self._fd).st_size
        end = size
        while end > 0:
            start = max(0, end - _TAIL_READ)
            newline = os.pread(self._fd, end - start, start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end < size:
            os.ftruncate(self._fd, end)
        return end

    def append(self, line: str) -> None:
        """Write `line` (which must end with a newline) whole, or raise and leave the file as it was."""
        self._refuse_if_failed()
        self.check_in_place()
        data = line.encode("utf-8")
        try:
            written = 0
            while written < len(data):  # a full disk may take part of a line, then refuse the rest
                written += os.write(self._fd, data[written:])
        except OSError as e:
            self._fail(e)
        self.length += len(data)

    def sync(self) -> None:
        """fsync: the lines written so far survive a crash of the machine."""
        self._refuse_if_failed()
        self.check_in_place()
        try:
            os.fsync(self._fd)
        except OSError as e:
            self._fail(e)

    def close(self) -> None:
        """Close without raising (an fsync that fails here is no worse than a crash: the next open cuts an
        incomplete last line off). Idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.failed is None:
                os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def _refuse_if_failed(self) -> None:
        if self.failed is not None:
            raise self.failed
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")

    def check_in_place(self) -> None:
        """FileMoved (and no more lines) when the path no longer leads to this file or the file does not end
        where this writer left it; the lines written are kept (see the module docstring)."""
        if self._fd is None or self.failed is not None:
            return
        own = os.fstat(self._fd)
        try:
            seen = os.stat(self.path)
        except FileNotFoundError:
            seen = None
        except OSError:
            return  # the path cannot be looked at (a permission, a flaky mount): the write itself will tell
        if seen is None:
            kept = self._copy_lines_to(self.path)
            error = FileMoved(self.path, "it was deleted while this process was writing it; " + (
                f"its {kept} lines were written back there" if isinstance(kept, int) else
                f"its lines could not be written back there ({kept})"),
                "run the same command to resume from the last committed checkpoint" if isinstance(kept, int) else
                "start a new run directory")
        elif (seen.st_dev, seen.st_ino) != (own.st_dev, own.st_ino):
            saved = self.path.with_name(f"{self.path.name}.detached-{os.getpid()}")
            kept = self._copy_lines_to(saved)
            error = FileMoved(self.path, "another file was put in its place while this process was writing it; " + (
                f"this process's {kept} lines were saved to {saved}" if isinstance(kept, int) else
                f"this process's lines could not be saved to {saved} ({kept})"),
                f"put the right file back at {self.path} (" + (f"mv {saved} {self.path}" if isinstance(kept, int)
                                                               else "from a copy") + ") and run the same command")
        elif own.st_size != self.length:
            error = FileMoved(self.path, f"it holds {own.st_size} bytes where this process wrote {self.length}: "
                              "another program cut it or wrote to it",
                              f"restore {self.path} from a copy, or start a new run directory")
        else:
            return
        self.failed = error  # not cut back: the file at hand is not (or no longer only) this writer's
        raise error

    def _copy_lines_to(self, path: pathlib.Path) -> int | str:
        """Write the lines written so far to a new file at `path`: how many, or why that failed."""
        data = os.pread(self._fd, self.length, 0)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            return e.strerror or str(e)
        try:
            _write_all(fd, data)  # a write cut short leaves an incomplete last line, which the next open cuts off
        except OSError as e:
            return e.strerror or str(e)
        finally:
            os.close(fd)
        return data.count(NEWLINE)

    def _fail(self, error: OSError) -> None:
        self.failed = error
        try:
            os.ftruncate(self._fd, self.length)
        except OSError:
            pass  # the next open cuts an incomplete last line off anyway
        raise error
