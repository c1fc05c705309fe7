"""Entry point of a rank in a fresh interpreter: ``python -m gpudiag.runtime.rank_process
RANK WORLD BACKEND FOLDER TIMEOUT LOGS PARENT`` (see :mod:`gpudiag.runtime.launch`).

A module of its own, so the rank imports :mod:`gpudiag.runtime.rank_side` under its real
name (running that module as ``__main__`` would make a second copy of it)."""

import signal
import sys

# Ctrl-C in a terminal reaches every process of the group: the launcher stops the ranks
# itself (SIGTERM, then SIGKILL), so a rank ignores it rather than print a traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)

from gpudiag.runtime.rank_side import RankSpec, rank_main  # noqa: E402

if __name__ == "__main__":
    rank_main(RankSpec.from_argv(sys.argv[1:]))
