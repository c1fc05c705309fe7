"""Imported only inside the rank forkserver (the last of its preload modules): when the
server is told to stop (its parent exited), its interpreter — torch and all — leaves
with ``os._exit`` instead of a full teardown, which took over a second and kept the
parent's pipes open until it finished (``gpudiag … | tee`` waited for it)."""

import atexit
import os

atexit.register(os._exit, 0)
