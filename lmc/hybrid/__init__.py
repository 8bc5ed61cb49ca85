"""Hybrid models: KV groups of different kinds (full attention, sliding windows, states)
stored and served per group, all or nothing per hit (:mod:`lmc.hybrid.rules`)."""
