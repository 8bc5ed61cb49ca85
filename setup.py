"""Only the optional C extension lives here; everything else is in pyproject.toml.

``lmc._tokens`` packs Python lists of token ids for hashing; ``lmc._kvcodecs`` holds the KV
codecs' CPU kernels (one pass per group, the GIL released). Both are optional: a machine
without a C compiler still installs lmc and uses the pure-Python packing and the torch
formulation of the codecs (the same bytes, several times slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("lmc._tokens", ["lmc/csrc/tokens.c"], optional=True, extra_compile_args=["-O3"]),
    # no fused multiply-adds: the kernels' arithmetic is the torch path's, rounding for rounding
    Extension("lmc._kvcodecs", ["lmc/csrc/kvcodecs.c"], optional=True,
              extra_compile_args=["-O3", "-ffp-contract=off"]),
])
