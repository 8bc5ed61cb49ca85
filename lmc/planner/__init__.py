"""Capacity planner (``lmc plan``): how big must each tier be for this traffic?

A trace is replayed through lmc's own chunking and chain keys and lmc's own tier classes
(the L1 ``CPUBackend`` over a byte-free address pool, so its LRU, reference counts and TLSF
allocator are the real ones), with no KV bytes moved, for a grid of tier sizes and write
policies. A cost model calibrated on the machine (``lmc plan --calibrate``) turns per-tier
hits into TTFT. See ``docs/planner.md``.
"""
