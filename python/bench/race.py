"""A torch kernel launched right after cuferry hands over a tensor whose upload is still in
flight reads the uploaded bytes: run under compute-sanitizer (racecheck, memcheck).

    compute-sanitizer --tool racecheck python3 python/bench/race.py

Loads a small checkpoint with ``cuferry.load`` (the uploads still queued when it returns) and
at once runs torch kernels on every tensor, with no synchronization in between; compares with
safetensors' load. Exits nonzero when a value differs.
"""

import os
import sys
import tempfile

import torch
import safetensors.torch as st
import cuferry


def main() -> int:
    gen = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(1024, 1024 + i, generator=gen).to(torch.bfloat16) for i in range(16)}
    path = os.path.join(tempfile.mkdtemp(), "race.safetensors")
    st.save_file(state, path)
    loaded = cuferry.load(path, device=0)
    sums = {k: (v.float() * 2).sum() for k, v in loaded.items()}  # no sync before
    expected = {k: (v.cuda().float() * 2).sum() for k, v in state.items()}
    torch.cuda.synchronize()
    bad = [k for k in state if not torch.equal(sums[k], expected[k])]
    print(f"race: {len(state)} tensors read by torch right after cuferry.load, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
