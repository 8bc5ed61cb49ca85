"""Segment caching with selective recompute (the CacheBlend method) for the reference engine.

A prompt's reusable segments (retrieved documents, files) are cached by their own content,
computed as if each started at position 0, and placed at their new position when a prompt
reuses them: K is rotated by the position difference, and the tokens whose cached KV
deviates most from what the prompt's context would give are recomputed. See
``docs/blending.md`` for the design, the quality gate and what other engines would need.

Modules: ``keys`` (segment keys, spans, the separator convention), ``rope_shift`` (placing
a segment), ``select`` (which tokens to recompute), ``store`` (segments in lmc's tiers),
``blender`` (the engine-facing planner), ``connector`` (the gate and the no-flooding save
rule around the reference connector), ``setting`` (a recompute ratio as the quality gate
reads it), ``lossy`` (blending judged by ``lmc quality``), ``gate`` (``lmc blend-check``, its
old name), ``rag_workload``.
"""
