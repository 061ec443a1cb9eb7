"""SIGTERM/SIGINT for a preemptible run (StopSignals): the first signal stops the learner after its step, which
saves; a second exits at once. Counted when the signal arrives, even while the main thread waits in C++.

Used by run.trainer; JAX-free.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger(__name__)


class StopSignals:
    """SIGTERM/SIGINT handling for a preemptible run: the first signal asks the learner to stop after the
    current step (and save); a second exits the process at once (128 + the signal, one line on stderr).

    Both act when the signal arrives, even while the main thread waits inside C++ (a collective, a device
    step), where Python runs no signal handler until the call returns (and two signals meanwhile would
    merge into one): the interpreter's C-level handler writes one byte per signal to a pipe
    (signal.set_wakeup_fd), and a watchdog thread reads it. The Python-level handler reads it too, so that a
    signal the main thread sends itself counts before its next line; each byte is read by one of them, so
    each signal counts once. Only the main thread can install signal handlers; elsewhere (a trainer run
    from a worker thread) this does nothing and stop() still works."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._signals = 0  # this process's own signals: a stop() asked by another process is not one of them
        self._previous: dict = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._watchdog: threading.Thread | None = None
        self._reading = threading.RLock()  # the handler may run again inside itself (a signal during it)
        self._active = False

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._pipe = os.pipe()
        for fd in self._pipe:
            os.set_blocking(fd, False)  # set_wakeup_fd needs it (a signal handler must never block)
        self._watchdog = threading.Thread(target=self._watch, name="grpo-stop-signals", daemon=True)
        self._watchdog.start()
        self._active = True
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._active = False  # from here on a signal is the previous handlers' (its byte may still come)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            os.write(self._pipe[1], b"\0")  # no signal is 0: tells the watchdog to end
            self._watchdog.join()
            for fd in self._pipe:
                os.close(fd)
            self._pipe = self._watchdog = None

    def _handle(self, signum, frame) -> None:
        self._count_pending()  # this signal's byte is already in the pipe (unless the watchdog took it)

    def _watch(self) -> None:
        import select

        while True:
            select.select([self._pipe[0]], [], [])
            if not self._count_pending():
                return

    def _count_pending(self) -> bool:
        """Count the signals whose bytes wait in the pipe; False once the end byte is read. Logs outside the
        lock: the main thread may be inside logging when its handler runs."""
        first = None
        with self._reading:
            try:
                pending = os.read(self._pipe[0], 64)
            except BlockingIOError:
                pending = b""  # the other reader took them
            for signum in pending:
                if signum == 0:
                    return False
                if not self._active or signum not in self.SIGNALS:
                    continue
                self._signals += 1
                name = signal.Signals(signum).name
                if self._signals > 1:
                    # Nothing more is written; the last committed checkpoint is where a resume starts.
                    os.write(2, f"grpo-jax: second {name}: exiting at once without saving; a resume starts from the "
                                f"last committed checkpoint\n".encode())
                    os._exit(128 + signum)
                self.received, first = signum, name
        if first is not None:
            logger.warning("received %s: finishing the current step, then saving a checkpoint and exiting "
                           "(send it again to exit at once)", first)
        return True

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a preemption stop without a signal (tests, embedding code, another process's signal)."""
        self.received = signum
