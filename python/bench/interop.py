"""Measures the interop targets on a GPU machine with torch and safetensors, all in one run.

1. Loading a 64-tensor bf16 checkpoint (8 GiB by default) onto device 0, from the page cache:
   ``cuferry.load`` into torch tensors, the crate's own loader alone (``native=True``: the
   same loader, no torch hand-off), and ``safetensors.torch.load_file(path, device="cuda")``.
   Every tensor of cuferry's load is compared with safetensors'.
2. The host time of one DLPack exchange: ``torch.utils.dlpack.to_dlpack``/``from_dlpack`` of a
   torch tensor, beside cuferry's ``Tensor.__dlpack__`` and ``cuferry.from_dlpack`` (each with
   its Python call). The crate's own, without Python, is the GPU test
   ``dlpack::measure_dlpack_host_time``.

    python3 python/bench/interop.py [--gib 8] [--dir /tmp] [--repeats 3]

Prints one line per measurement; exits nonzero when a tensor differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def timed(fn, repeats):
    import torch

    times, result = [], None
    for _ in range(repeats):
        result = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    import safetensors.torch as st
    import cuferry

    tensors = 64
    per = int(args.gib * 2**30) // tensors // 2  # bf16 elements per tensor
    cols = 8192
    rows = per // cols
    path = os.path.join(args.dir, f"cuferry-interop-{args.gib:g}gib.safetensors")
    if not os.path.exists(path):
        gen = torch.Generator(device="cuda").manual_seed(0)
        state = {
            f"layer{i:02}.weight": torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.bfloat16).cpu()
            for i in range(tensors)
        }
        st.save_file(state, path)
        del state
    size = os.path.getsize(path)
    # Into the page cache, for every loader alike.
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)
    gib = size / 2**30
    print(f"checkpoint: {path}, {tensors} bf16 tensors of [{rows}, {cols}], {gib:.2f} GiB")

    results = {}
    for name, fn in [
        ("cuferry.load (torch tensors)", lambda: cuferry.load(path, device=0)),
        ("cuferry loader alone (native=True)", lambda: cuferry.load(path, device=0, native=True)),
        ("safetensors.torch.load_file(device='cuda')", lambda: st.load_file(path, device="cuda")),
    ]:
        times, result = timed(fn, args.repeats)
        results[name] = (times, result)
        best = min(times)
        print(
            f"load: {name}: best {best:.3f} s ({gib / best:.2f} GiB/s), "
            f"median {statistics.median(times):.3f} s, runs {[round(t, 3) for t in times]}"
        )
    ours = results["cuferry.load (torch tensors)"][1]
    theirs = results["safetensors.torch.load_file(device='cuda')"][1]
    assert set(ours) == set(theirs), "the two loads hold different names"
    differing = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    print(f"load: {len(theirs)} tensors compared with safetensors, {len(differing)} differ")
    best = {k: min(v[0]) for k, v in results.items()}
    torch_load = best["cuferry.load (torch tensors)"]
    alone = best["cuferry loader alone (native=True)"]
    safetensors_load = best["safetensors.torch.load_file(device='cuda')"]
    print(
        f"load: ratios: cuferry.load / loader alone = {alone / torch_load:.3f}x, "
        f"cuferry.load / safetensors = {safetensors_load / torch_load:.2f}x"
    )
    del ours, theirs, results
    torch.cuda.empty_cache()

    # The host time of one DLPack exchange, through Python on both sides.
    n = 20000
    t = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        capsule = torch.utils.dlpack.to_dlpack(t)
    to_torch = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    from_torch = (time.perf_counter() - start) / n - to_torch
    print(f"dlpack: torch to_dlpack {to_torch * 1e6:.2f} us, from_dlpack {from_torch * 1e6:.2f} us (Python calls included)")
    x = cuferry.load(path, device=0, native=True, select=["layer00.weight"])["layer00.weight"]
    stream = torch.cuda.current_stream().cuda_stream or 1
    export = imp = 0.0
    for _ in range(n):
        start = time.perf_counter()
        capsule = x.__dlpack__(stream=stream, max_version=(1, 0))
        middle = time.perf_counter()
        x = cuferry.from_dlpack(_Capsule(capsule))
        end = time.perf_counter()
        export += middle - start
        imp += end - middle
    torch.cuda.synchronize()
    print(
        f"dlpack: cuferry Tensor.__dlpack__ {export / n * 1e6:.2f} us, "
        f"cuferry.from_dlpack {imp / n * 1e6:.2f} us (Python calls included)"
    )
    return 1 if differing else 0


class _Capsule:
    """A producer that hands over a capsule made already."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return self.capsule

    def __dlpack_device__(self):
        return (2, 0)


if __name__ == "__main__":
    sys.exit(main())
