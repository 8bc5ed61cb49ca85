"""lmc's small HTTP servers: the bounded JSON request handling they share (``json_api``) and the
prefill/decode proxy (``pd_proxy``)."""
