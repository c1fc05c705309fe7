"""``gpudiag hang``: which rank is stuck, in which collective, at which line (docs/hang.md).

:mod:`.reader` reads flight-recorder dumps (pickle through the bounded unpickler, JSON) into
:class:`~.reader.Dump`; :mod:`.analysis` finds, per process group, the first collective not
completed by every member and who caused it; :mod:`.result` is what the command renders
(``to_json()``, ``exit_code()``, text and markdown). Nothing here imports torch.
"""
