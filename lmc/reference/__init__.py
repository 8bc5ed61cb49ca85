"""lmc's built-in reference inference engine: a small paged-KV engine for Llama-family
checkpoints (Llama 2/3, Qwen2), with the KV connector hooks lmc plugs into.

    from lmc.reference import LLM, default_model_dir
    llm = LLM(default_model_dir())
    print(llm.generate(["The cache"], max_tokens=8)[0].text)
"""

from lmc.reference.connector_api import ConnectorRequest, KVConnector
from lmc.reference.engine import LLM
from lmc.reference.outputs import RequestOutput
from lmc.reference.request import SamplingParams
from lmc.reference.scheduler_output import ScheduledRequest, SchedulerOutput
from lmc.reference.tiny import default_model_dir, make_tiny_checkpoint

__all__ = [
    "LLM",
    "ConnectorRequest",
    "KVConnector",
    "RequestOutput",
    "SamplingParams",
    "ScheduledRequest",
    "SchedulerOutput",
    "default_model_dir",
    "make_tiny_checkpoint",
]
