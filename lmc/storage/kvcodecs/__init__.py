"""KV codecs: lossy (and lossless) stages a tier declares, so it holds more KV per byte.

``base`` (the interface: the geometry a codec declares, its layer blocks, its error bound),
one codec per module (``fp8``, ``int8``, ``int4``), ``lossless`` (zstd, lz4), ``stage`` (a
tier's codec and compressor, the value header, the key namespace), ``tier`` (the ``codec``
wrapper tier a ``tiers:`` entry's ``codec:`` builds) and ``gate`` (a codec only where the
quality verdict for the model passes). docs/codecs.md says how to choose one.
"""
