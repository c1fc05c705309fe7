"""``gpudiag transport``: which path NCCL chose for each GPU pair, and whether it should have.

:mod:`.reader` reads ``NCCL_DEBUG=INFO`` logs into connections; :mod:`.analysis` groups
them into pairs, puts the topology beside them and raises findings
(:class:`~gpudiag.transport.report.TransportReport`).
"""
