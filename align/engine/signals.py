"""Ctrl-C and SIGTERM during a run (StageRun installs them when it opens --out and restores them at its end).

Inside the step loop a signal asks the run to stop after the step: the step finishes, every rank learns of it
through the step's all-reduce, the run checkpoints and exits 130 / 143. Anywhere else, or Ctrl-C a second time, it
stops at once. SIGTERM is one request however often it comes: a worker told of its launcher's death
(PR_SET_PDEATHSIG) gets one SIGTERM per thread of the dead launcher, and a repeat must not break off the graceful
stop (one rank gone mid-collective would fail its peers) nor the failure report being written.
"""

from __future__ import annotations

import signal

from align.console import info
from align.errors import Terminated


class Signals:
    """The run's handlers of SIGINT and SIGTERM and what they were asked."""

    def __init__(self):
        self.requested: int | None = None  # SIGINT / SIGTERM received during the step loop
        self.sigterm = False  # a SIGTERM has been received (any later one is the same request)
        self.in_loop = False  # inside the step loop: a signal stops the run at the end of the step
        self._replaced: dict = {}  # the handlers `install` replaced, put back by `restore`

    def install(self) -> None:
        self._replaced = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        """The handlers as they were; a stop on SIGTERM ignores its repeats to the end of the process."""
        for sig, handler in self._replaced.items():
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGTERM and self.sigterm else handler)

    def _on_signal(self, signum, frame) -> None:
        """In the step loop: note the request (the loop stops after the step); else, or a second Ctrl-C: stop now."""
        if signum == signal.SIGTERM and self.sigterm:
            return
        self.sigterm = self.sigterm or signum == signal.SIGTERM
        if not self.in_loop or self.requested is not None:
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated()
        self.requested = signum
        again = "Ctrl-C again" if signum == signal.SIGINT else "SIGKILL"
        info(f"[yellow]{signal.Signals(signum).name}: stopping after this step (checkpoint, then exit); "
             f"{again} to stop at once[/]")
