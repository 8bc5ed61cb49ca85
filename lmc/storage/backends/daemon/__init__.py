"""The ``lmc://`` tier: an engine's remote tier served by ``lmc server`` (``backend``), and its
integrity tags (``tags``)."""
