"""``gpudiag sweep`` stopped by a signal: one line, exit 130 / 143, no rank process and no
``gpudiag-sweep-*`` folder left — also when the signal lands at the worst moment, right
after a rank was forked, while Python runs its at-fork hooks (logging's among them), where
an exception raised by a signal handler is printed as "Exception ignored" and lost.

The test arranges the timing (an at-fork hook of its own sends the signal); the product
code is unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import SEED_MACHINE
from tests.helpers.procfs import session_processes

SEED = SEED_MACHINE

#: Runs ``gpudiag sweep`` with a hook that sends the signal (argv[1]: INT or TERM, to this
#: process or its group) as the first rank is forked: in the parent, after the fork.
WRAPPER = textwrap.dedent(
    """
    import os, signal, sys
    signum, whom = getattr(signal, "SIG" + sys.argv[1]), sys.argv[2]
    sent = []

    def after_fork_in_parent():
        if not sent:
            sent.append(1)
            if whom == "group":
                os.killpg(0, signum)  # (a terminal's Ctrl-C, Slurm's scancel)
            else:
                os.kill(os.getpid(), signum)
            sum(range(10000))  # (Python code after the signal: where its handler runs)

    import logging  # noqa: F401  (its own at-fork hooks first, as in every gpudiag run)
    os.register_at_fork(after_in_parent=after_fork_in_parent)
    sys.argv = ["gpudiag", *sys.argv[3:]]
    from gpudiag.cli import main
    main()
    """
)


@pytest.mark.parametrize(("sig", "whom"), [("INT", "group"), ("TERM", "self")])
def test_a_signal_right_after_a_fork_stops_the_sweep(tmp_path: Path, sig: str, whom: str) -> None:
    doc = json.loads(SEED.read_text())
    doc["labels"], doc["gpus"] = doc["labels"][:2], doc["gpus"][:2]
    doc["matrix"] = [["X", "NV4"], ["NV4", "X"]]
    (tmp_path / "m.json").write_text(json.dumps(doc))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(scratch),
        "GPUDIAG_HOSTNAME": "n0",
        "GPUDIAG_RANK_START": "auto",
        "OMP_NUM_THREADS": "1",
    }
    args = ["sweep", "-o", str(tmp_path / "out"), "--machine", str(tmp_path / "m.json"), "--quick"]
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, sig, whom, *args, "--checks", "env"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    signum = getattr(signal, "SIG" + sig)
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == f"gpudiag: interrupted by SIG{sig}; stopped", err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert sum("gpudiag:" in line for line in lines) == 1, err
    assert session_processes(proc.pid) == [], "rank processes left behind"
    assert [p.name for p in scratch.iterdir() if p.name.startswith("gpudiag-")] == []
    assert not (tmp_path / "out").exists()


def test_an_interruption_lost_where_python_ignores_exceptions_is_raised_again() -> None:
    """A signal whose handler runs inside a ``__del__`` (any place Python prints "Exception
    ignored" from) still stops the command, at the next line of ordinary code."""
    code = textwrap.dedent(
        """
        import os, signal, time
        from gpudiag.cli import stop_on_signals
        from gpudiag.errors import Interrupted
        stop_on_signals()

        class Finalised:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(10000))

        try:
            Finalised()
            time.sleep(20)
            print("lost")
        except Interrupted as exc:
            print("raised", exc.signum)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == f"raised {int(signal.SIGINT)}", (done.stdout, done.stderr)
    assert "Exception ignored" not in done.stderr, done.stderr
