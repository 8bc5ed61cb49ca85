"""The server tier: ``ServerBackend``, registered as ``"server"``, URLs ``lmc://`` and
``lmc+unix://``, an engine's remote tier served by ``lmc server`` (the daemon). The protocol
lives here with its client (``protocol``, ``client``, ``probe``: when to ask which values the
daemon already holds), the tier itself is ``backend`` and its integrity tags ``tags``; the
daemon (:mod:`lmc.server`) imports the protocol from here."""
