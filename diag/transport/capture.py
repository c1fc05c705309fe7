"""NCCL's ``INFO`` lines of ranks gpudiag launches, captured to private files and read back.

:class:`NcclCapture` owns one private temporary folder (mode 0700, :func:`gpudiag.cleanup.track`\\ ed
so that Ctrl-C or SIGTERM removes it too; removed when the block ends). Ranks launched inside
``capture.ranks(name)`` write their stdout and stderr to ``<folder>/<name>/launch<N>-rank<R>.log``
(:func:`gpudiag.runtime.launch.rank_logs`), never to the user's terminal, with ``NCCL_DEBUG=INFO``
and ``NCCL_DEBUG_SUBSYS=INIT,P2P,NET,GRAPH`` where the user set neither (:func:`nccl_debug`;
a value the user set is kept, :func:`user_settings` names it). :func:`folder_texts` reads such a
folder's logs and :func:`read_rank_logs` turns them into a
:class:`~gpudiag.transport.report.TransportReport` as ``gpudiag transport --from-log`` would.

Used by the live ``gpudiag transport`` (:mod:`.live`) and by ``gpudiag bench``'s DDP cases on CUDA.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType

from gpudiag.topology.model import Topology
from gpudiag.transport.report import TransportReport

#: What NCCL is asked to log (only the variables the user did not set).
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,NET,GRAPH"}


def user_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`DEBUG_ENV` the user set (kept as they are), by name."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in DEBUG_ENV if name in environ}


@contextlib.contextmanager
def nccl_debug() -> Iterator[None]:
    """NCCL_DEBUG=INFO and the subsystems with connection lines, for the ranks started
    inside (they inherit this environment); the user's own values are kept, and what was
    added is taken away again when the block ends."""
    added = [name for name in DEBUG_ENV if name not in os.environ]
    for name in added:
        os.environ[name] = DEBUG_ENV[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class NcclCapture:
    """A private folder for ranks' logs, removed at the end of the ``with`` block (and by
    :func:`gpudiag.cleanup.clean_up` on a signal). Use :meth:`ranks` around each launch."""

    def __init__(self, prefix: str = "gpudiag-nccl-") -> None:
        self.prefix = prefix
        self.folder: Path | None = None

    def __enter__(self) -> NcclCapture:
        from gpudiag.cleanup import track
        from gpudiag.runtime.launch import signals_held

        with signals_held():  # (a signal between the two would leave the folder untracked)
            self.folder = track(Path(tempfile.mkdtemp(prefix=self.prefix)))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        from gpudiag.cleanup import untrack

        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            untrack(self.folder)
            self.folder = None

    @contextlib.contextmanager
    def ranks(self, name: str) -> Iterator[Path]:
        """Ranks launched inside write their output under ``<folder>/<name>``, NCCL asked
        for its connection lines (:func:`nccl_debug`)."""
        from gpudiag.runtime.launch import rank_logs

        if self.folder is None:
            raise RuntimeError("NcclCapture.ranks() outside its with block")
        with nccl_debug(), rank_logs(self.folder / name) as folder:
            yield folder


def folder_texts(folder: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """``(text, file name)`` of every ``*.log`` in ``folder``, in name order (bounded as
    every NCCL log gpudiag reads: :func:`gpudiag.transport.run.read_log_file`)."""
    from gpudiag.transport.run import read_log_file

    return [read_log_file(str(path)) for path in sorted(Path(folder).glob("*.log")) if path.is_file()]


def read_rank_logs(
    folder: str | os.PathLike[str], topology: Topology | None = None
) -> TransportReport | None:
    """The transport report of the rank logs in ``folder`` (pairs and findings, with the
    topology beside them when given); None when no log there holds a line of NCCL's own
    (``NCCL INFO``/``NCCL WARN``: a gloo run, or NCCL_DEBUG left unset or at a level that
    printed nothing)."""
    return texts_report(folder_texts(folder), topology)


def texts_report(texts: list[tuple[str, str]], topology: Topology | None = None) -> TransportReport | None:
    """:func:`read_rank_logs` on texts already read; the report keeps them (``nccl_logs``)."""
    from gpudiag.transport.analysis import analyze
    from gpudiag.transport.reader import read_log

    log = read_log(texts)
    # (gpudiag's own first line of a rank log names NCCL_DEBUG: NCCL's own lines say INFO or WARN)
    if not log.connections and not any("NCCL INFO" in text or "NCCL WARN" in text for text, _ in texts):
        return None
    report = analyze(log, topology)
    report.nccl_logs = [(name, text) for text, name in texts]
    return report


def live_topology() -> Topology | None:
    """This machine's topology from NVML, or None where NVML cannot be read."""
    from gpudiag.errors import GpudiagError
    from gpudiag.hw.nvml import NvmlBackend

    try:
        with NvmlBackend() as backend:
            return backend.topology()
    except GpudiagError:
        return None
