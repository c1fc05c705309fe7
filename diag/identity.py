"""This machine's host name, the one way gpudiag learns it.

``GPUDIAG_HOSTNAME`` overrides the real name everywhere (reports, redaction, ``gpudiag
sweep``'s node names): several simulated "nodes" on one machine each get their own name,
and a cluster whose host names are not the names people use can say so. The shell
equivalent is ``hostname``; Python's is :func:`socket.gethostname`.
"""

from __future__ import annotations

import os
import socket

#: The environment variable that overrides the host name.
HOSTNAME_VARIABLE = "GPUDIAG_HOSTNAME"


def host_names() -> list[str]:
    """Every name this machine goes by here: :func:`hostname` (the override when set) and
    the kernel's own name — what ``--anonymize`` masks; with ``GPUDIAG_HOSTNAME`` set the
    real name still shows in paths (``NCCL_DEBUG_FILE=/logs/$(hostname)/…``) and logs."""
    names = [hostname(), _kernel_hostname()]
    return [n for i, n in enumerate(names) if n and n not in names[:i]]


def _kernel_hostname() -> str:
    try:
        return socket.gethostname()
    except OSError:
        return ""


def hostname() -> str:
    """``GPUDIAG_HOSTNAME`` when set (and not blank), else the kernel's host name; ``""``
    when neither can be read."""
    override = os.environ.get(HOSTNAME_VARIABLE, "").strip()
    if override:
        return override
    return _kernel_hostname()
