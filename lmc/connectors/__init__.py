"""lmc engine connectors: thin adapters from an engine's hooks onto lmc's connector core."""
