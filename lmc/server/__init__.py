"""The node-wide cache-server daemon (``lmc server``) and its wire protocol."""
