"""The quality harness: every lossy KV feature (segment blending, KV codecs) judged against
exact KV on the model it would run on, and the gate that turns it on only where it passed.

* ``feature``: what a lossy KV feature implements to be judged, and the registry of them.
* ``verdict``: one verdict per (weights, dtype, feature, setting), in files next to the model.
* ``gate``: the decision a component serving lossy KV asks for at start-up.
* ``metrics``, ``runner``, ``docqa``, ``harness``, ``check``: the measurement.
* ``cast``: the simplest feature (KV rounded to a narrower float), the harness's calibration.
* ``cli``: ``lmc quality``.

Importing the package imports nothing else: a tier asking the gate pays for the gate only.
See docs/quality.md.
"""
