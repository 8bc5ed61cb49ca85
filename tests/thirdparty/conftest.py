"""``toy_tier_pkg/`` is a separate project with its own test file: run by
``test_thirdparty_tier.py`` in a child pytest, never collected by lmc's own run."""

collect_ignore = ["toy_tier_pkg"]
