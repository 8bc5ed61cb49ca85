"""The model identity in the key namespace: which weights computed a chunk's KV.

Two engines share KV only if they run the same weights, so the identity must change when any
byte of the weights does, and must not change with where the checkpoint lies on disk (a copy
on another machine; vLLM and the reference engine loading the same files). Every adapter
derives it here, by one rule, in this order:

1. **An identity the operator names** (``model_id``: ``lmc.vllm.model_id``, SGLang's
   ``lmc.model_id``, the reference connector's ``model_id=``) is used as given. The operator
   answers for it: engines given one name share KV whatever their weights.
2. **A revision the operator names** (the ``model_revision`` setting, e.g. a release tag or
   a commit) replaces the digest of the weights' bytes; the folder's name, ``config.json``
   (and quantization configs) and each weight file's name and size still count. Start-up
   then reads no weights. The risk is the operator's: weights changed in place without a
   new revision (same file sizes) are served the old weights' KV.
3. **Otherwise, every byte of the weights**: the folder's name, the bytes of
   ``config.json`` and of quantization configs (``*quant*.json``), and, per weight file
   (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf`` at the top of the folder),
   its name, size and the digest of all its bytes (:mod:`.weight_digest`). Digests are
   cached per file state (:mod:`.digest_cache`), so only the first start on a checkpoint
   reads it (at several GB/s; ``benchmarks/bench_model_identity.py``).

A model an engine names but lmc cannot find on disk (a hub name not in the local cache)
gets ``<name>@<revision>``, with a WARNING unless the revision is a pinned commit: a moving
revision (``main``) would share KV across the hub's updates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from pathlib import Path

import xxhash

from lmc.connectors.core.digest_cache import DigestCache
from lmc.connectors.core.weight_digest import FileState, Progress, digest_files, file_state
from lmc.units import rate, seconds, size

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
IDENTITY_FORMAT = b"lmc.model-identity/2\0"
_COMMIT = re.compile(r"[0-9a-f]{40}")


def config_files(root: Path) -> list[Path]:
    """What configures the model besides its weights: ``config.json`` and quantization
    configs, by name."""
    extra = sorted(p for p in root.glob("*quant*.json") if p.is_file())
    return [root / "config.json", *extra]


def weight_files(root: Path) -> list[Path]:
    """The weight files at the top of a checkpoint folder, by name."""
    return sorted(p for p in root.iterdir()
                  if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def model_identity(model_dir: str | os.PathLike, revision: str | None = None,
                   cache: DigestCache | None = None) -> str:
    """``"<folder name>@<16 hex digits>"`` for a local checkpoint folder, by rule 3 of the
    module (rule 2 when ``revision`` is given)."""
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} is not a checkpoint directory: no config.json")
    weights = weight_files(root)
    if not weights and not revision:
        raise ValueError(f"{root} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}): the "
                         "model identity must cover the weights; name them with the "
                         "model_revision setting, or give model_id")
    name = root.resolve().name
    h = xxhash.xxh3_128(IDENTITY_FORMAT)
    for path in config_files(root):
        data = path.read_bytes()
        h.update(f"{path.name}:{len(data)}:".encode() + data)
    states = {p.name: file_state(p) for p in weights}
    if revision:
        h.update(f"revision:{len(revision)}:{revision}".encode())
        for fname, st in states.items():
            h.update(f"{fname}:{st.size}\0".encode())
        identity = f"{name}@{h.hexdigest()[:16]}"
        log.info("model identity %s: revision %r as named by model_revision (%d weight files, "
                 "%s, not read)", identity, revision, len(states),
                 size(sum(s.size for s in states.values())))
        return identity
    digests = weight_digests(list(states.values()), name, cache or DigestCache())
    for fname, st in states.items():
        h.update(f"{fname}:{st.size}:{digests[st.path]}\0".encode())
    return f"{name}@{h.hexdigest()[:16]}"


def weight_digests(states: list[FileState], name: str, cache: DigestCache) -> dict[str, str]:
    """``{real path: digest}``: from the cache where the file is unchanged, else hashed (files
    another process is hashing are waited for, not read twice). One INFO line says which."""
    t0 = time.monotonic()
    out = cache.lookup(states)
    missing = [s for s in states if s.path not in out]
    total = sum(s.size for s in states)
    if not missing:
        log.info("model identity of %s: digests of %d weight files (%s) from the cache, "
                 "not read", name, len(states), size(total))
        return out
    todo = sum(s.size for s in missing)
    progress = Progress(todo, lambda done, whole, dt: log.info(
        "model identity of %s: %s of %s of weights hashed (%.0f%%), %s", name, size(done),
        size(whole), 100 * done / max(whole, 1), seconds(dt)))
    mine: list[FileState] = []
    deferred: list[FileState] = []
    with contextlib.ExitStack() as held:
        for s in missing:
            (mine if held.enter_context(cache.claim(s.path, wait=0)) else deferred).append(s)
        out.update(cache.lookup(mine))  # finished by another process before our claim
        out.update(_hash(cache, [s for s in mine if s.path not in out], progress))
    for s in deferred:  # another process claimed it: wait for its digest
        with cache.claim(s.path, wait=max(60.0, s.size / 100e6)):
            out.update(cache.lookup([s]) or _hash(cache, [s], progress))
    dt = time.monotonic() - t0
    others = len(states) - len(missing)
    if cache.path is None:
        where = ": no (cache folder unusable)"
    elif progress.uncached:
        where = (f" in {cache.path}, but for {progress.uncached} file(s) changed in the last "
                 "seconds (hashed again next time)")
    else:
        where = f" in {cache.path}"
    log.info("model identity of %s: hashed %s of weights in %s (%s)%s; digests cached%s",
             name, size(progress.done), seconds(dt), rate(progress.done / max(dt, 1e-9)),
             f", {others} more files' digests from the cache" if others else "", where)
    return out


def _hash(cache: DigestCache, states: list[FileState], progress: Progress) -> dict[str, str]:
    if not states:
        return {}
    results = digest_files([s.path for s in states], progress)
    progress.uncached += len(results) - cache.put(results)
    return {path: digest for path, (_, digest) in results.items()}


# ------------------------------------------------------------------ engines' models
def local_checkpoint(model: str, hub_revision: str | None = None) -> Path | None:
    """The folder an engine's model name means here: itself if it is a local folder, else
    its snapshot in the Hugging Face cache (never downloaded); None when there is none."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=hub_revision, local_files_only=True))
    except Exception:  # not installed, not cached, not a hub name
        return None


def engine_model_id(model: str, *, explicit: str | None = None, revision: str | None = None,
                    hub_revision: str | None = None, setting: str = "model_id") -> str:
    """The identity of an engine's model by the module's rule: ``explicit`` (the operator's
    ``setting``), else the checkpoint's (``revision``: the ``model_revision`` setting), else,
    for a model not on disk, ``<name>@<revision>``."""
    if explicit:
        log.info("model identity %s: as named by %s (the operator answers for the weights)",
                 explicit, setting)
        return explicit
    path = local_checkpoint(model, hub_revision) if model else None
    if path is not None:
        return model_identity(path, revision=revision)
    pinned = revision or hub_revision
    identity = f"{model}@{pinned or 'main'}"
    if revision or (hub_revision and _COMMIT.fullmatch(hub_revision)):
        log.info("model identity %s: %s is not on disk here; its name and pinned revision "
                 "name it", identity, model)
    else:
        log.warning("model identity %s: %s is not on disk here, so its weights cannot be "
                    "read; its name and revision %r name it, and if the weights behind them "
                    "change, engines are served the old weights' KV (pin a commit, or set "
                    "model_revision or %s)", identity, model, pinned or "main", setting)
    return identity
