"""Times PyTorch's own way of loading a safetensors file onto a GPU from the page cache: the
tensors read into host memory (``safetensors.torch.load_file(path, device="cpu")``), each
copied into pinned memory (``pin_memory()``) and sent with ``cuda(non_blocking=True)``, then one
``torch.cuda.synchronize()``. The baseline the crate's loader is measured beside
(``checkpoint::measure_checkpoint_defaults`` runs it on the file it loads).

    python3 python/bench/pin_memory.py PATH [--repeats 5]

Prints one line per load, ``pin_memory path: <seconds> s, <GiB/s> GiB/s``, after one load that
is not timed (it warms torch's caching allocators, as the crate's loader is warmed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    import safetensors.torch as st

    size = os.path.getsize(args.path)

    def load():
        host = st.load_file(args.path, device="cpu")
        out = {k: t.pin_memory().cuda(non_blocking=True) for k, t in host.items()}
        torch.cuda.synchronize()
        return out

    load()
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = load()
        secs = time.perf_counter() - start
        del out
        print(f"pin_memory path: {secs:.4f} s, {size / secs / 2**30:.2f} GiB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
