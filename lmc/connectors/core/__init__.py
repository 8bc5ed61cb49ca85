"""The engine-agnostic connector core every adapter translates onto: the scheduler half
(``scheduler``), the worker half (``worker``), what passes between them (``metadata``), the
cross-process lookup service, model identity and prefill/decode parameters."""
