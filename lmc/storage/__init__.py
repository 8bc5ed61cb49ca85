"""Where chunks live: the tier contract (``tier``), the chain built from config (``chain``), the
manager that promotes and writes behind over it (``manager``, ``write_behind``,
``layered_read``), eviction policies, the shared tiers' header, framing and integrity, KV
codecs (``kvcodecs``), wrapper tiers, and one module or folder per backend under
``backends/``."""
