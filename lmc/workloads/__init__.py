"""Workloads: one trace format, generators for the standard KV-offloading workloads,
and replay against a real engine (``lmc workload``, ``lmc replay``)."""

from lmc.workloads.trace import TraceError, TraceRequest, read_trace, write_trace

__all__ = ["TraceError", "TraceRequest", "read_trace", "write_trace"]
