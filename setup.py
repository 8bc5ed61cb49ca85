"""Only the optional C extension lives here; everything else is in pyproject.toml.

``lmc._tokens`` packs Python lists of token ids for hashing. It is optional: a machine
without a C compiler still installs lmc and uses the pure-Python packing (slower on lists).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("lmc._tokens", ["lmc/csrc/tokens.c"], optional=True,
                             extra_compile_args=["-O3"])])
