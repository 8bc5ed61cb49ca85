"""``LLM``: the reference engine's front door. Loads a local checkpoint, owns the
scheduler, block manager and model runner, and runs steps until requests finish.

A step is: schedule -> connector meta -> forward (with per-layer connector hooks) ->
load-error rollback -> sample -> advance/finish requests. See ``connector_api`` for the
exact order of the connector calls. A request that cannot be served (its sampling or its
connector hooks raise) fails alone: it finishes with an error (``pop_error``) and the
engine goes on with the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from lmc.models.chat import ChatTemplate
from lmc.reference.block_manager import BlockManager
from lmc.reference.connector_api import KVConnector, connector_module
from lmc.reference.kv_cache import bytes_per_block, layer_name
from lmc.reference.loader import load_model, resolve_dtype
from lmc.reference.model_runner import ModelRunner
from lmc.reference.outputs import RequestOutput
from lmc.reference.request import Request, SamplingParams
from lmc.reference.sampling import sample_tokens
from lmc.reference.scheduler import Scheduler, one_line
from lmc.reference.scheduler_output import SchedulerOutput
from lmc.reference.segments import check_spans, encode_pieces, split_text
from lmc.reference.tokenizer import Tokenizer, load_eos_token_ids

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Messages = Sequence[dict[str, Any]]  # one conversation: {"role", "content"} dicts
MAX_ERRORS = 4096  # failed requests' errors kept for pop_error


class LLM:
    """A paged-KV inference engine for a local Llama/Qwen2 checkpoint.

    Args:
        model_dir: directory with ``config.json``, ``*.safetensors`` and (for text
            prompts) ``tokenizer.json``. Never downloads anything.
        dtype: "float32" | "bfloat16" | "float16" | "auto" (checkpoint's) or a torch dtype.
        device: "cpu", "cuda", "cuda:N".
        block_size: tokens per KV block.
        num_blocks: KV blocks in the cache; by default enough for ``max_num_seqs``
            sequences of ``max_model_len`` tokens, capped at ``kv_cache_memory`` bytes.
        max_num_batched_tokens: token budget per step (prefills longer than this are
            chunked across steps).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (prompt + output); defaults to the config's
            ``max_position_embeddings`` and is lowered to what the cache can hold, so a
            request alone always fits.
        kv_cache_memory: byte cap for the default ``num_blocks``.
        kv_connector: optional ``KVConnector``; absent means no external KV at all. A
            connector with a ``blender`` (see ``model_runner.Blender``) blends prompts that
            mark segments.
        lmc_config: shorthand for the connector registered as ``"lmc"``
            (``connector_api.CONNECTOR_MODULES``), built for this checkpoint: a
            ``CacheConfig``, a YAML path or a dict of keys.
        blend: with ``lmc_config``: reuse marked segments anywhere in a prompt (segment
            caching with selective recompute, ``lmc.blend``): ``True``, or the blend
            settings as a dict. Enabled only for a model with a passing ``lmc quality``
            verdict for blend (or an explicit override).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        kv_cache_memory: int = 256 << 20,
        kv_connector: KVConnector | None = None,
        lmc_config: Any = None,
        blend: bool | dict[str, Any] | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.model = load_model(self.model_dir, dtype, self.device)
        self.config = self.model.config
        self.dtype = resolve_dtype(dtype, self.config)
        self.block_size = block_size

        tok_path = self.model_dir / "tokenizer.json"
        self.tokenizer = Tokenizer(tok_path) if tok_path.is_file() else None
        self.eos_token_ids = load_eos_token_ids(self.model_dir, self.config)
        # the checkpoint's own template (tokenizer_config.json), or None: LLM.chat, and the
        # server's /v1/chat/completions, render conversations with it
        self.chat_template = ChatTemplate.from_model_dir(self.model_dir)

        max_len = max_model_len or self.config.max_position_embeddings
        if num_blocks is None:
            wanted = max_num_seqs * -(-max_len // block_size)
            affordable = kv_cache_memory // bytes_per_block(self.config, block_size, self.dtype)
            num_blocks = max(1, min(wanted, affordable))
        if max_len > num_blocks * block_size:
            logger.info("max_model_len lowered to %d to fit the KV cache", num_blocks * block_size)
            max_len = num_blocks * block_size
        self.max_model_len = max_len
        self.num_blocks = num_blocks

        self.block_manager = BlockManager(num_blocks)
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.dtype, self.device)
        if blend and lmc_config is None:
            raise ValueError("blend needs lmc_config (segments are stored in lmc)")
        if blend and self.config.sliding_windows:
            raise ValueError("blend: segment blending is not supported for a hybrid "
                             "sliding-window/full model (a segment's K/V would need each "
                             "layer's window); run without blend")
        if lmc_config is not None:
            if kv_connector is not None:
                raise ValueError("pass kv_connector or lmc_config, not both")
            kv_connector = connector_module("lmc").build_connector(
                lmc_config, model_dir=self.model_dir, blend=blend)
        self.kv_connector = kv_connector
        self.scheduler = Scheduler(
            self.block_manager, block_size, max_num_batched_tokens, max_num_seqs,
            self.max_model_len, kv_connector,
        )
        if kv_connector is not None:
            if self.config.sliding_windows:  # a hybrid sliding-window/full model
                kv_connector.register_kv_windows({layer_name(i): self.config.layer_window(i)
                                                  for i in range(self.config.num_hidden_layers)})
            kv_connector.register_kv_caches(self.runner.named_kv_caches())
            self.runner.blender = getattr(kv_connector, "blender", None)
        self._ids = itertools.count()
        self._errors: dict[str, str] = {}  # request id -> why it failed (see pop_error)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.runner.kv_caches

    # --------------------------------------------------------------- requests

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id(s) out of range [0, {self.config.vocab_size}): {bad[:5]}")
        return ids

    def encode_chat(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        """A conversation's prompt ids: the checkpoint's chat template rendered, then
        tokenized with no special tokens added (the template writes them). ``ValueError``
        (``ChatTemplateError``) naming a bad message, or when the checkpoint has no
        template or tokenizer."""
        if self.chat_template is None or self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no chat template (tokenizer_config.json's "
                             "chat_template) and tokenizer.json; send prompts instead")
        text = self.chat_template.render(messages, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_segments(self, prompt: Prompt, segments: Sequence[Sequence[int]] | None = None,
                        separator: str | None = None) -> tuple[list[int], list[tuple[int, int]]]:
        """A prompt's token ids and its reusable segments' ``(start, end)`` spans: given
        (checked against the prompt), or, for a text prompt with ``separator``, the pieces
        between separators but the last (each piece tokenized alone; the separators are
        not part of the prompt)."""
        if separator is not None:
            if segments is not None:
                raise ValueError("pass segments or segment_separator, not both")
            if not isinstance(prompt, str):
                raise ValueError("segment_separator applies to text prompts; mark token-id "
                                 "prompts with segments=")
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json; pass token ids")
            tokenizer = self.tokenizer
            return encode_pieces(split_text(prompt, separator),
                                 lambda text, special: tokenizer.encode(text, special))
        ids = self.encode(prompt)
        return ids, check_spans(segments, len(ids)) if segments else []

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        kv_transfer_params: dict | None = None, *,
        segments: Sequence[Sequence[int]] | None = None, segment_separator: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Arrival time (for TTFT) is now.
        ``kv_transfer_params``: prefill/decode parameters for the KV connector (vLLM's
        shape: ``{"do_remote_decode": True}`` asks a producer to prefill for another
        instance; a producer's answer, passed to a consumer, makes it pull the prompt).
        ``segments`` / ``segment_separator``: the prompt's reusable segments (see
        :meth:`encode_segments`), blended when the connector blends."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        spans: list[tuple[int, int]] = []
        if segments is not None or segment_separator is not None:
            ids, spans = self.encode_segments(prompt, segments, segment_separator)
            self.encode(ids)  # range-checks token ids
        else:
            ids = self.encode(prompt)
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            prompt=prompt if isinstance(prompt, str) else None,
            kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params else None,
            segments=spans or None,
        )
        self.scheduler.add_request(request)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its (partial) output."""
        request = self.scheduler.requests.get(request_id)
        if request is None or not self.scheduler.abort_request(request_id):
            return None
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it, failed ones
        included (finish reason ``abort``; :meth:`pop_error` says why).

        A request that fails alone (its sampling, its connector hooks) is finished with its
        error and the rest of the batch goes on; a failure of the step itself (the forward)
        fails the requests scheduled in it, never those still waiting, so the engine is
        left with no request that would fail the next step again."""
        output = self.scheduler.schedule()
        try:
            finished = self._run(output)
        except Exception as e:
            error = f"engine step failed: {one_line(e)}"
            logger.debug("step %d: %s", output.step_id, error)
            finished = []
            if output.is_empty:  # the asynchronous loads' poll failed: fail what waits on it
                involved = list(self.scheduler.loading)
            else:
                involved = [sched.request_id for sched in output.scheduled_requests]
            for rid in involved:
                request = self.scheduler.requests.get(rid)
                if request is not None:
                    self.scheduler.fail_request(request, error)
        return finished + self._drain_failed()

    def pop_error(self, request_id: str) -> str | None:
        """Why a request returned by :meth:`step` as aborted failed (once), or None."""
        return self._errors.pop(request_id, None)

    def _drain_failed(self) -> list[RequestOutput]:
        outs = []
        for request, error in self.scheduler.failed:
            self._errors[request.request_id] = error
            outs.append(self._output(request))
        self.scheduler.failed.clear()
        while len(self._errors) > MAX_ERRORS:  # kept for callers that never ask
            self._errors.pop(next(iter(self._errors)))
        return outs

    def _run(self, output: SchedulerOutput) -> list[RequestOutput]:
        connector = self.kv_connector
        meta = connector.build_connector_meta(output) if connector is not None else None
        if output.is_empty:
            if connector is not None and self.scheduler.has_remote_loads:
                # no forward, but asynchronous loads to start (in meta) and to collect
                connector.start_load_kv(meta)
                connector.wait_for_save()
                done = connector.get_finished()
                self.scheduler.finish_remote_loads(
                    done, set(connector.get_block_ids_with_load_errors()))
                if not done:
                    time.sleep(0.001)  # nothing else to run: do not spin on the poll
            return []
        segments = {}
        if self.runner.blender is not None:
            for sched in output.scheduled_requests:
                request = self.scheduler.requests.get(sched.request_id)
                if request is not None and request.segments:
                    segments[sched.request_id] = request.segments
        sample_ids, logits = self.runner.execute(output, connector, meta, segments)
        invalid: set[str] = set()
        if connector is not None:
            done = connector.get_finished()  # before the errors: they include its blocks
            bad_blocks = set(connector.get_block_ids_with_load_errors())
            invalid = self.scheduler.handle_load_errors(output, bad_blocks)
            self.scheduler.finish_remote_loads(done, bad_blocks)

        keep = [i for i, rid in enumerate(sample_ids) if rid not in invalid]
        requests = [self.scheduler.requests[sample_ids[i]] for i in keep]
        logits = logits[keep].cpu()
        tokens = self._sample(logits, requests)
        now = time.perf_counter()
        for row, request in enumerate(requests):
            if request.first_token_time is None:
                request.first_token_time = now
            if request.sampling_params.return_logits:
                request.logits.append(logits[row].clone())
        sampled = {r.request_id: t for r, t in zip(requests, tokens, strict=True)
                   if not isinstance(t, str)}
        finished = self.scheduler.update_after_step(output, sampled, invalid)
        for r, t in zip(requests, tokens, strict=True):
            if isinstance(t, str) and not r.is_finished:
                self.scheduler.fail_request(r, t)
        return [self._output(r) for r in finished]

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int | str]:
        """One token per row, in one batch; if that fails, row by row, so that only the
        rows that fail get an error (a string) instead of a token."""
        params = [r.sampling_params for r in requests]
        gens = [r.generator for r in requests]
        try:
            return list(sample_tokens(logits, params, gens))
        except Exception:
            pass
        out: list[int | str] = []
        for i in range(len(requests)):
            try:
                out.append(sample_tokens(logits[i:i + 1], params[i:i + 1], gens[i:i + 1])[0])
            except Exception as e:
                out.append(f"sampling failed: {one_line(e)}")
        return out

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
        kv_transfer_params: dict | Sequence[dict | None] | None = None,
        segments: Sequence[Any] | None = None,
        segment_separator: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs in prompt
        order. ``seed`` seeds every request's own generator (see ``SamplingParams``).
        ``kv_transfer_params``: one dict for every prompt or one per prompt (see
        ``add_request``). ``segments``: the reusable ``(start, end)`` token spans of a
        single prompt, or one list (or None) per prompt; ``segment_separator``: text
        prompts are split into segments at it (see :meth:`encode_segments`). Runs the
        engine until these requests finish (other queued requests progress too)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            batch: list[Prompt] = [cast(Prompt, prompts)]  # a single prompt
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
            ignore_eos=ignore_eos, stop_token_ids=tuple(stop_token_ids),
            return_logits=return_logits,
        )
        if kv_transfer_params is None or isinstance(kv_transfer_params, dict):
            kv_params = [kv_transfer_params] * len(batch)
        else:
            kv_params = list(kv_transfer_params)
            if len(kv_params) != len(batch):
                raise ValueError(f"{len(kv_params)} kv_transfer_params for {len(batch)} "
                                 "prompts")
        if segments is None:
            seg_lists: list[Any] = [None] * len(batch)
        elif len(batch) == 1 and (not segments or _is_span(segments[0])):
            seg_lists = [segments]
        else:
            seg_lists = list(segments)
            if len(seg_lists) != len(batch):
                raise ValueError(f"{len(seg_lists)} segment lists for {len(batch)} prompts")
        ids = [self.add_request(p, params, kv_transfer_params=kp, segments=sg,
                                segment_separator=segment_separator)
               for p, kp, sg in zip(batch, kv_params, seg_lists)]
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        while pending and self.has_unfinished_requests():
            for out in self.step():
                results[out.request_id] = out
                pending.discard(out.request_id)
        errors = [(i, e) for i in ids if (e := self.pop_error(i)) is not None]
        if errors:
            raise RuntimeError("; ".join(f"request {i}: {e}" for i, e in errors))
        return [results[i] for i in ids]

    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or several (a
        list of them), each rendered by the checkpoint's chat template (:meth:`encode_chat`);
        generation stops at the end of the assistant's turn (the checkpoint's EOS ids, e.g.
        ``<|im_end|>``). Other keywords as :meth:`generate`; outputs in order."""
        single = bool(conversations) and isinstance(conversations[0], dict)
        batch = [conversations] if single else list(conversations)
        prompts = [self.encode_chat(cast(Messages, c)) for c in batch]
        return self.generate(prompts, max_tokens, temperature, top_p, seed, **kwargs)

    def close(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers

    def _output(self, request: Request) -> RequestOutput:
        text = self.tokenizer.decode(request.output_token_ids) if self.tokenizer else ""
        ttft = None
        if request.first_token_time is not None:
            ttft = request.first_token_time - request.arrival_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=list(request.output_token_ids),
            text=text,
            ttft_s=ttft,
            num_cached_tokens=request.num_cached_tokens,
            finish_reason=request.finish_reason,
            logits=torch.stack(request.logits) if request.logits else None,
            kv_transfer_params=request.kv_transfer_params_out,
        )


def _is_span(value: Any) -> bool:
    """A ``(start, end)`` pair of ints (a single prompt's segment), not a list of them."""
    return (isinstance(value, Sequence) and len(value) == 2
            and all(isinstance(v, int) for v in value))
