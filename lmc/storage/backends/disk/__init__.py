"""The local disk tier: ``backend`` (files, index, I/O) and ``layered`` (its layer-by-layer read)."""
