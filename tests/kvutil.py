"""Test helpers: engine KV caches of every layout filled with random bits, and bit-exact checks."""

from __future__ import annotations

import torch

from lmc.transfer.kv_spec import KVSpec
from lmc.transfer.plan import INT_VIEW

DTYPES = [torch.float32, torch.float16, torch.bfloat16] + (
    [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


def random_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids below 30000, the same for the same seed (prompts for the tier tests)."""
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def random_bits(shape, dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infs included): a round trip must keep every bit."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), dtype=torch.uint8,
                        generator=gen)
    return raw.view(dtype).to(device)


def make_caches(layout: str, *, layers=3, heads=2, dim=8, blocks=12, block_size=4,
                dtype=torch.float32, device="cpu", seed=0, zeros=False, order="NHD"):
    """KV caches as the engine of ``layout`` holds them (MLA: ``dim`` is the latent size).

    ``vllm_gpu`` layers are ``[blocks, heads, block_size, 2*dim]`` views of memory in vLLM's
    ``order``: "NHD" (``[blocks, block_size, heads, 2*dim]``, vLLM's default) or "HND"."""
    gen = torch.Generator().manual_seed(seed)
    slots = blocks * block_size
    shapes = {
        "vllm_flash": (2, blocks, block_size, heads, dim),
        "vllm_flashinfer": (blocks, 2, block_size, heads, dim),
        "vllm_mla": (blocks, block_size, dim),
        "vllm_cpu": (blocks, heads, block_size, 2 * dim),
        "sglang_mha": (slots, heads, dim),
        "sglang_mla": (slots, 1, dim),
        "vllm_gpu": ((blocks, block_size, heads, 2 * dim) if order == "NHD"
                     else (blocks, heads, block_size, 2 * dim)),
    }
    shape = shapes[layout]

    def one():
        if zeros:
            t = torch.zeros(shape, dtype=torch.uint8 if dtype.itemsize == 1 else dtype,
                            device=device).view(dtype)
        else:
            t = random_bits(shape, dtype, gen, device)
        return t.transpose(1, 2) if layout == "vllm_gpu" and order == "NHD" else t

    if layout == "sglang_mha":
        return ([one() for _ in range(layers)], [one() for _ in range(layers)])
    return [one() for _ in range(layers)]


def spec_for(layout: str, caches) -> KVSpec:
    return KVSpec.from_tensors(caches, layout)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.element_size()][0])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    ne = (bits(a.cpu()) != bits(b.cpu()))
    assert not bool(ne.any()), f"{what}: {int(ne.sum())} elements differ"


def token_kv(spec: KVSpec, caches, slots: torch.Tensor) -> torch.Tensor:
    """Reference gather written the slow, obvious way: ``[layers, planes, n, heads*dim]``.

    Independent of lmc.transfer.torch_copy so that tests check it against the layout definitions.
    """
    layers = spec.split_layers(caches)
    bs, H, D = spec.block_size, spec.num_kv_heads, spec.head_size
    out = torch.zeros(spec.chunk_shape(len(slots)), dtype=torch.uint8 if spec.dtype.itemsize == 1
                      else spec.dtype).view(spec.dtype)
    for li, (_, ts) in enumerate(layers):
        for i, s in enumerate(slots.tolist()):
            b, o = divmod(s, bs)
            for p in range(spec.num_planes):
                if spec.layout == "vllm_flash":
                    v = ts[0][p, b, o]
                elif spec.layout == "vllm_flashinfer":
                    v = ts[0][b, p, o]
                elif spec.layout == "vllm_mla":
                    v = ts[0][b, o]
                elif spec.layout == "vllm_cpu":
                    slab = ts[0][b].reshape(H, -1)
                    v = (slab[:, : D * bs].reshape(H, D, bs)[:, :, o] if p == 0
                         else slab[:, D * bs:].reshape(H, bs, D)[:, o, :])
                elif spec.layout == "vllm_gpu":  # vLLM: kv.transpose(1, 2).split(D, -1)
                    v = ts[0].transpose(1, 2).split(D, -1)[p][b, o]
                elif spec.layout == "sglang_mha":
                    v = ts[p][s]
                else:
                    v = ts[0][s]
                out[li, p, i] = v.reshape(-1).cpu()
    return out
