"""lmc storage tiers, one module each; every module registers itself with
``lmc.storage.tier.register_backend`` and is listed in the ``lmc.storage.backends``
entry-point group."""
