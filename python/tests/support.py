"""Helpers for the tests: safetensors files written by hand (struct + json), and the simulator.

The files are written here rather than with the safetensors package so the tests need nothing
but the standard library; the layout is the format's: an 8-byte little-endian header length, a
JSON header (padded with spaces to a multiple of 8), then the tensors' bytes.
"""

import json
import struct

import cuferry
import cuferry._native as native

# Per-element distinct values, never zeros (the crate's rule for correctness data).
F32 = [1.5, -2.25, 3.0e10, 0.125, -7.0, 42.0]
I64 = [-(2**40), -1, 7, 2**62, 3, -5]
BOOL = [True, False, True, True, False, True]
BF16 = [1.0, -2.0, 0.5, 3.25, -0.125, 96.0]


def f32_bytes(values):
    return struct.pack(f"<{len(values)}f", *values)


def bf16_bytes(values):
    # bf16 is the top half of an f32; these values are exact in bf16.
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def i64_bytes(values):
    return struct.pack(f"<{len(values)}q", *values)


def bool_bytes(values):
    return bytes(int(v) for v in values)


def sample_tensors():
    """name -> (safetensors dtype, shape, bytes), of four element types."""
    return {
        "w.f32": ("F32", [2, 3], f32_bytes(F32)),
        "b.bf16": ("BF16", [6], bf16_bytes(BF16)),
        "idx.i64": ("I64", [3, 2], i64_bytes(I64)),
        "mask.bool": ("BOOL", [2, 1, 3], bool_bytes(BOOL)),
        "scalar.f32": ("F32", [], f32_bytes([0.75])),
        "empty.f32": ("F32", [0, 4], b""),
    }


# cuferry's names for the file's element types.
DTYPES = {"F32": "f32", "BF16": "bf16", "I64": "i64", "BOOL": "bool"}


def write_safetensors(path, tensors, metadata=None):
    """Writes name -> (dtype, shape, bytes) as a safetensors file, in the given order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, raw in tensors.values():
            f.write(raw)


def read_safetensors(path):
    """name -> (dtype, shape, bytes) of a safetensors file, and its metadata."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    metadata = header.pop("__metadata__", None)
    body = data[8 + n :]
    out = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        out[name] = (entry["dtype"], entry["shape"], body[start:end])
    return out, metadata


def write_sharded(directory, shards):
    """Writes shards (file name -> tensors) and their index; returns the index's path."""
    weight_map = {}
    for file_name, tensors in shards.items():
        write_safetensors(directory / file_name, tensors)
        for name in tensors:
            weight_map[name] = file_name
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def simulated():
    """Whether this build can simulate devices; switches to them if so."""
    if not hasattr(native, "_use_simulator"):
        return False
    native._use_simulator()
    return True


SKIP_NO_SIM = (
    "the extension was built without the simulated device: build it with "
    "`bash python/build.sh --sim`"
)

__all__ = ["cuferry"]
