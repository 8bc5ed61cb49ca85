"""Copy-engine bandwidth by kind of page-locked host memory, and what the driver accepts.

Why: on an H100 a staged gather (kernel into device memory, then ``cudaMemcpyAsync`` into
lmc's pool) ran at 0.49 of a plain pinned memcpy while the H2D direction ran at 0.95, and
2D copies over two registrations were refused. This prints, for 512 MiB each way through
CuPy's runtime (what lmc's copies use), the bandwidth into and out of:

  * torch's pinned allocator (``cudaHostAlloc``): the peer every benchmark compares against;
  * lmc's pool memory (``mmap``, 2 MiB aligned, huge pages where granted) registered with
    ``cudaHostRegister`` in one call, and the same on 4 KiB pages;
  * a 1D copy and a 2D copy whose host extent runs over two adjacent registrations
    (accepted? how fast?);

and whether the driver reports a registration's extent (``cuPointerGetAttribute`` range
attributes). Without a CUDA device it says so and exits 0.

    python benchmarks/probe_pinned_memory.py [--mib 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_pinned_memory: no CUDA device on this machine: skipped")
        return 0
    import cupy
    from cupy.cuda import runtime as rt

    from lmc.memory.prefault import CudaRegistrar, host_alloc

    n = args.mib * MiB
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    reg = CudaRegistrar()
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "mib": args.mib}

    def bw(host_ptr: int, direction: str, nbytes: int = n, pieces: int = 1) -> float:
        """GiB/s of ``pieces`` 1D copies of ``nbytes`` in all, one direction."""
        step = nbytes // pieces

        def once() -> None:
            for i in range(pieces):
                if direction == "D2H":
                    rt.memcpyAsync(host_ptr + i * step, dev.data_ptr() + i * step, step,
                                   rt.memcpyDefault, stream.cuda_stream)
                else:
                    rt.memcpyAsync(dev.data_ptr() + i * step, host_ptr + i * step, step,
                                   rt.memcpyDefault, stream.cuda_stream)

        once()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            once()
        stream.synchronize()
        return nbytes * args.iters / (time.perf_counter() - t0) / 2**30

    def row(name: str, ptr: int, **kw: int) -> None:
        d2h, h2d = bw(ptr, "D2H", **kw), bw(ptr, "H2D", **kw)
        out[name] = {"D2H": d2h, "H2D": h2d}
        print(f"  {name:44s} D2H {d2h:6.2f} GiB/s   H2D {h2d:6.2f} GiB/s", flush=True)

    print(f"{out['device']}: {args.mib} MiB each way, {args.iters} iterations, CuPy runtime "
          f"copies on one stream")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    row("torch pinned (cudaHostAlloc)", pinned.data_ptr())
    row("torch pinned, 16 copies of 32 MiB", pinned.data_ptr(), pieces=16)
    for huge in (True, False):
        buf, pages = host_alloc(n, huge=huge)
        buf.fill_(1)
        reg.register(buf.data_ptr(), n)
        try:
            row(f"mmap {pages} pages, one cudaHostRegister", buf.data_ptr())
            row(f"mmap {pages} pages, 16 copies of 32 MiB", buf.data_ptr(), pieces=16)
        finally:
            reg.unregister(buf.data_ptr())
    # two adjacent registrations of one mapping, halves of it
    buf, pages = host_alloc(n, huge=True)
    buf.fill_(1)
    half = n // 2
    reg.register(buf.data_ptr(), half)
    reg.register(buf.data_ptr() + half, half)
    try:
        row(f"mmap {pages}, two registrations, halves", buf.data_ptr(), pieces=2)
        for what in ("D2H", "H2D"):
            try:
                g = bw(buf.data_ptr(), what)
                out[f"1D across registrations {what}"] = g
                print(f"  1D copy across two registrations, {what}: accepted, {g:.2f} GiB/s")
            except rt.CUDARuntimeError as e:
                out[f"1D across registrations {what}"] = str(e)
                print(f"  1D copy across two registrations, {what}: refused ({e})")
        try:
            rows = 8
            pitch = n // rows
            rt.memcpy2DAsync(buf.data_ptr(), pitch, dev.data_ptr(), MiB, MiB, rows,
                             rt.memcpyDefault, stream.cuda_stream)
            stream.synchronize()
            out["2D across registrations"] = "accepted"
            print("  2D copy with rows in both registrations: accepted")
        except rt.CUDARuntimeError as e:
            out["2D across registrations"] = str(e)
            print(f"  2D copy with rows in both registrations: refused ({e})")
        try:  # does the driver say where a registration ends? (CU_POINTER_ATTRIBUTE_RANGE_*)
            from cuda.bindings import driver as cu

            probe = buf.data_ptr() + half + 4096
            got = []
            for attr in (cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                         cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_SIZE):
                err, val = cu.cuPointerGetAttribute(attr, probe)
                got.append((str(err), int(val) if val is not None else None))
            rel = (got[0][1] - buf.data_ptr()) if got[0][1] else None
            out["range attributes"] = {"result": got, "start - buffer": rel, "half": half}
            print(f"  range attributes of a registered address: {got} (start at buffer + "
                  f"{rel}, the second registration begins at + {half})")
        except Exception as e:  # noqa: BLE001 - a probe: say what happened
            out["range attributes"] = repr(e)
            print(f"  range attributes: {e!r}")
    finally:
        reg.unregister(buf.data_ptr())
        reg.unregister(buf.data_ptr() + half)
    del cupy
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
