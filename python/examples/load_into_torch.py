"""A checkpoint straight into torch tensors, a torch computation on them, and a save.

    python3 python/examples/load_into_torch.py model.safetensors [out.safetensors]

With torch installed and a GPU, the tensors are torch tensors on cuda:0: each was handed over
through DLPack with torch's current stream waiting, on the device, for its last copy, so the
first torch kernel needs no synchronization. Without torch, ``load`` returns ``cuferry.Tensor``
objects, whose bytes are read back with ``to_bytes()``.
"""

import sys

import cuferry


def main(path, out=None):
    state = cuferry.load(path, device=0, progress=True)
    for name, tensor in state.items():
        print(f"{name}: {tuple(tensor.shape)} {tensor.dtype}")
    try:
        import torch
    except ImportError:
        first = next(iter(state.values()), None)
        if first is not None:
            print(f"first tensor: {first.nbytes} bytes, starting {first.to_bytes()[:8].hex()}")
        return
    # Read at once, on torch's stream: it waits on the device for the load's copies.
    norms = {name: t.float().norm().item() for name, t in state.items() if t.is_floating_point()}
    for name, norm in norms.items():
        print(f"{name}: norm {norm:.4f}")
    if out is not None:
        cuferry.save(out, {name: t * 2 for name, t in state.items()})
        print(f"saved {len(state)} tensors, doubled, to {out}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
