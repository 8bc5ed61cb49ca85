"""Real models for lmc, offline: known models (``registry``), converted on first use from an
installed package's GGUF file into a Hugging Face-format checkpoint (``get``, ``convert``,
``gguf_weights``, ``gguf_tokenizer``) kept under lmc's cache folder (``store``), and the one
place messages become prompt text (``chat``).

    from lmc.models import checkpoint_dir
    from lmc.reference import LLM

    llm = LLM(checkpoint_dir("smollm2-135m-instruct"), dtype="bfloat16")
    print(llm.chat([{"role": "user", "content": "What is the capital of France?"}]).text)

Importing this package is cheap: torch, gguf and safetensors load only when a conversion runs.
"""

from lmc.models.chat import ChatTemplate, ChatTemplateError
from lmc.models.get import DEFAULT_MODEL, Checkpoint, checkpoint_dir, get_model
from lmc.models.registry import KNOWN_MODELS, KnownModel, known_model
from lmc.models.source import SourceError, SourceMissing

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ChatTemplate",
    "ChatTemplateError",
    "Checkpoint",
    "KnownModel",
    "SourceError",
    "SourceMissing",
    "checkpoint_dir",
    "get_model",
    "known_model",
]
