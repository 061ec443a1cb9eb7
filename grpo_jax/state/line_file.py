"""Append-only files of complete lines (the ledger, metrics.jsonl, eval.jsonl) that a full disk cannot tear.

Each line goes straight to an O_APPEND descriptor (os.write, repeated only when a full disk takes part of it):
no Python buffer keeps a line that failed and hands it to the disk later (a later flush would write a line
whose effect nothing recorded). A line the disk refuses, even in part, is cut off at once, and the file takes
no line after it (`failed`), so the file only ever holds complete lines in the order they were accepted. An
incomplete last line left by a crash is cut off when the file is opened. Pure Python.
"""

from __future__ import annotations

import os
import pathlib

_TAIL_READ = 65536  # bytes read back at a time when looking for the last complete line


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

    def _fail(self, error: OSError) -> None:
        self.failed = error
        try:
            os.ftruncate(self._fd, self.length)
        except OSError:
            pass  # the next open cuts an incomplete last line off anyway
        raise error
