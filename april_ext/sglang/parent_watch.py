"""The parent-death signal for the servers a run launches: a server becomes its command through a short
``python -c`` program that arms Linux's PR_SET_PDEATHSIG and then execs the server, so the server ends when
the run's process dies, SIGKILL included.

The launcher starts servers in a session of their own (so that stopping one stops its whole process group),
which also keeps a SIGKILL of the run's process group from reaching them: without the signal they outlive the
run and keep their port and memory. The signal is SIGTERM, so the server stops as on ``stop()`` (SGLang's own
processes follow their parent the same way). The program imports nothing of april_ext: the server's interpreter
may be another environment's. The kernel ties the signal to the thread that forked; the launcher's callers fork
from the main thread or from a thread pool whose workers live as long as the run.
"""

from __future__ import annotations

import sys

_PROGRAM = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0) != 0:\n"  # 1: PR_SET_PDEATHSIG
    "    sys.exit('parent_watch: prctl(PR_SET_PDEATHSIG) failed: ' + os.strerror(ctypes.get_errno()))\n"
    # The parent died before the signal was armed: nobody would stop the server.
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('parent_watch: the parent ' + sys.argv[1] + ' is gone; not starting ' + sys.argv[2])\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def supported() -> bool:
    """The parent-death signal is Linux's (prctl); elsewhere a launched server is stopped only by stop()."""
    return sys.platform.startswith("linux")


def watched(parent_pid: int, argv: list[str], python: str = sys.executable) -> list[str]:
    """``argv`` run so that it ends with ``parent_pid``; ``argv`` unchanged where that is not supported."""
    if not supported():
        return list(argv)
    return [python, "-c", _PROGRAM, str(parent_pid), *argv]


__all__ = ["supported", "watched"]
