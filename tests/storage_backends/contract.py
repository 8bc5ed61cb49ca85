"""Moved: the tier contract suite is :mod:`lmc.testing` (one class per concern). Only these
names remain here, for ``tests/p2p/attack_proc.py``, which imports them from this path; once it
imports them from ``lmc.testing``, this file goes."""

from lmc.testing import SHAPE, check_hit, fill, key_of

__all__ = ["SHAPE", "check_hit", "fill", "key_of"]
