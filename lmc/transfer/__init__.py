"""Moving KV between an engine's cache and pool chunks: the layouts as data (``kv_spec``,
``kv_layouts``), the copy interface and its plans (``plan``), the copy paths on CPU/torch
(``torch_copy``) and CUDA (``cuda_copy``), choosing one (``factory``), the caches a transfer is
bound to (``bound_caches``) and the completion handles that own memory under a copy."""
