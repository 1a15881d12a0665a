"""Which signals the run's helper processes (the fork server, the workers) obey.

GNU `timeout`, systemd and Slurm stop a job by signalling every process in it at once, not only
the runner. A worker killed by that signal takes its sessions in flight with it, and a dead fork
server reads, to the runner, as the death of every worker. So the helpers ignore SIGINT and
SIGTERM: the runner alone decides how to stop (gently on the first signal, as for one Ctrl-C),
and tells its workers with CANCEL_SIGNAL, which nothing sends to a whole group.

The fork server's first preloaded module is runner/execution/shielded.py, whose import calls
`shield()`, so every worker it forks starts shielded. The runner blocks both signals
while it starts the fork server (`spawning_shielded`), so a signal that comes before the shield
is in place waits in the runner instead of killing the fork server.
"""

from __future__ import annotations

import contextlib
import signal

GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The runner to one worker: cancel your sessions, clean up, exit. A real-time signal, which no job
# scheduler sends to a whole job (Slurm's --signal is commonly USR1 or USR2, for checkpoints).
CANCEL_SIGNAL = int(signal.SIGRTMIN) + 1


def _ignore(signum, frame) -> None:
    """A handler, not SIG_IGN: programs the process starts get the default action back at exec."""


def shield() -> None:
    signal.signal(signal.SIGTERM, _ignore)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)


@contextlib.contextmanager
def spawning_shielded():
    """Block the group's signals in this thread while helper processes start (they inherit the mask
    and unblock it once shielded); a signal sent meanwhile is delivered here afterwards."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

