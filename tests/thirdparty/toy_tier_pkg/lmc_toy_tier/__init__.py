"""A toy lmc storage tier kept outside lmc: see :mod:`lmc_toy_tier.backend`."""
