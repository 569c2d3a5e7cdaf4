"""Serving: continuous batching over one ``Engine`` (``Scheduler``), the Triton model repository
(``criticalkv.serving.repository``) and the ``tritonserver`` launcher (``criticalkv.serving.launcher``)."""

from criticalkv.serving.scheduler import RequestError, RequestHandle, RequestOutput, Scheduler

__all__ = ["RequestError", "RequestHandle", "RequestOutput", "Scheduler"]
