"""The process's KV memory: the pool (``pool``), its TLSF allocator (``tlsf``), paying first-touch
page faults ahead of stores (``prefault``) and the debug invariants that catch misuse (``invariants``)."""
