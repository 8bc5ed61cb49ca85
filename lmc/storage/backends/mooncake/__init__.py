"""The ``mooncake://`` tier: a Mooncake Store cluster (a master and clients contributing
memory) as a shared tier. :mod:`.backend` is the tier, :mod:`.client` owns the library
client's lifecycle (the library crashes the process on a call after or during ``close()``),
:mod:`.heads` the registered memory values' heads travel through."""

from .backend import MooncakeBackend

__all__ = ["MooncakeBackend"]
