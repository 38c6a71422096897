"""cuferry's Python module against PyTorch on a real GPU (not collected by `unittest discover`).

Needs a CUDA device, torch and safetensors, and the extension built without `sim`:

    bash python/build.sh
    PYTHONPATH=python python3 python/tests/gpu_torch.py [--device N] [--bench-mib 1024]

Checks, each printed as it runs, with a closing `N passed, N failed` line and a nonzero exit
status on any failure:

- a checkpoint written by `safetensors.torch.save_file` (every element type both sides have,
  a tensor of several staging chunks, a scalar, an empty tensor) loads as torch tensors equal to
  `safetensors.torch.load_file(path, device="cuda")`, with the same dtype, shape and device;
  a sharded set through its index, `select` and `progress`;
- DLPack: `torch.from_dlpack` of a `cuferry.Tensor` and `cuferry.from_dlpack` of a torch
  tensor, both ways without a copy (the same device pointer), a strided torch tensor (copied
  compact), a tensor written on a side stream of torch's, DLPack 1.x and legacy capsules;
- `cuferry.save` of torch tensors: `safetensors.torch.load_file` reads back equal tensors, and
  the file is byte for byte `safetensors.torch.save_file`'s;
- errors: a malformed file raises `cuferry.Error` naming it.

And a timing, printed, not judged: `cuferry.load` beside `safetensors.torch.load_file` on a
checkpoint of `--bench-mib` MiB (warm page cache).
"""

import argparse
import os
import pathlib
import struct
import sys
import tempfile
import time
import traceback

import safetensors.torch
import torch

import cuferry

RESULTS = {"passed": 0, "failed": 0}


def check(name):
    """Runs the decorated function at once as one named check."""

    def run(fn):
        try:
            fn()
        except Exception:
            RESULTS["failed"] += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
        else:
            RESULTS["passed"] += 1
            print(f"ok   {name}", flush=True)
        return fn

    return run


def same(a, b, what):
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.device == b.device, f"{what}: device {a.device} != {b.device}"
    assert torch.equal(a, b), f"{what}: values differ"


def sample(device):
    """Tensors of every element type both sides have, with distinct values, never all zeros."""
    g = torch.Generator(device="cpu").manual_seed(7)
    big = 40 << 20  # 40 MiB: several of the engine's 16 MiB staging chunks
    out = {
        "f32": torch.randn(257, 129, generator=g),
        "f64": torch.randn(33, 7, generator=g, dtype=torch.float64),
        "f16": torch.randn(1000, generator=g).to(torch.float16),
        "bf16": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (77,), generator=g, dtype=torch.int8),
        "i16": torch.randint(-(2**15), 2**15 - 1, (77,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(2**31), 2**31 - 1, (9, 9), generator=g, dtype=torch.int32),
        "i64": torch.arange(-500, 500, dtype=torch.int64) * (2**33),
        "u8": torch.randint(0, 255, (4, 4, 4), generator=g, dtype=torch.uint8),
        "bool": torch.rand(123, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 8),
        "big": torch.randn(big // 4, generator=g),
        "odd.name/with:chars": torch.arange(11, dtype=torch.float32),
    }
    return {k: v.to(device) for k, v in out.items()}


def bytes_of(t):
    """A torch tensor's bytes, row-major, little-endian (on this little-endian host)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    try:
        return flat.numpy().tobytes()
    except (ImportError, RuntimeError):  # torch without numpy
        return bytes(flat.tolist())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--bench-mib", type=int, default=1024)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    ordinal = args.device
    cuda = torch.device(f"cuda:{ordinal}")
    torch.cuda.set_device(cuda)
    print(
        f"torch {torch.__version__}, safetensors {safetensors.__version__}, cuferry "
        f"{cuferry.__version__}, {torch.cuda.get_device_name(cuda)}",
        flush=True,
    )
    tmp = tempfile.TemporaryDirectory()
    d = pathlib.Path(tmp.name)
    tensors = sample(cuda)
    path = d / "model.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    reference = safetensors.torch.load_file(str(path), device=f"cuda:{ordinal}")

    @check("load: every tensor equals safetensors.torch.load_file's")
    def _():
        loaded = cuferry.load(path, device=ordinal)
        assert set(loaded) == set(reference), (sorted(loaded), sorted(reference))
        for name, t in loaded.items():
            assert isinstance(t, torch.Tensor), type(t)
            same(t, reference[name], name)

    @check("load: tensors outlive the dict and the module's objects, and can be written")
    def _():
        loaded = cuferry.load(path, device=ordinal)
        w = loaded.pop("f32")
        del loaded
        w.mul_(2)
        torch.cuda.synchronize()
        same(w, reference["f32"] * 2, "f32 * 2")

    @check("load: device as 'cuda:N' and torch.device")
    def _():
        for device in (f"cuda:{ordinal}", cuda):
            t = cuferry.load(path, device=device, select=["i64"])["i64"]
            same(t, reference["i64"], "i64")

    @check("load: select (names and callable) and progress")
    def _():
        calls = []
        got = cuferry.load(
            path, device=ordinal, select=lambda n: n.startswith("i"), progress=lambda d, t: calls.append((d, t))
        )
        assert sorted(got) == ["i16", "i32", "i64", "i8"], sorted(got)
        want = sum(reference[n].numel() * reference[n].element_size() for n in got)
        assert calls and calls[-1] == (want, want), (calls[-1:], want)
        got = cuferry.load(path, device=ordinal, select={"big", "bool"}, progress=True)
        same(got["big"], reference["big"], "big")

    @check("load: a sharded set through its index")
    def _():
        import json

        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        weight_map = {}
        for file_name, part in halves.items():
            safetensors.torch.save_file({n: tensors[n] for n in part}, str(d / file_name))
            weight_map.update({n: file_name for n in part})
        index = d / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        loaded = cuferry.load(index, device=ordinal)
        assert set(loaded) == set(reference)
        for name, t in loaded.items():
            same(t, reference[name], name)

    @check("load: native=True gives cuferry.Tensor, whose bytes are the file's")
    def _():
        native = cuferry.load(path, device=ordinal, native=True)
        for name, t in native.items():
            assert isinstance(t, cuferry.Tensor)
            assert t.device == ordinal and t.__dlpack_device__() == (2, ordinal)
            assert t.to_bytes() == bytes_of(reference[name]), name

    @check("dlpack: torch.from_dlpack of a cuferry.Tensor, DLPack 1.x and legacy")
    def _():
        native = cuferry.load(path, device=ordinal, native=True)
        t = torch.from_dlpack(native["bf16"])  # torch asks for max_version (1, 0)
        same(t, reference["bf16"], "bf16")
        assert native["bf16"].exported
        try:
            native["bf16"].__dlpack__()
        except BufferError:
            pass
        else:
            raise AssertionError("a second export did not raise BufferError")
        legacy = native["f32"].__dlpack__(stream=torch.cuda.current_stream(cuda).cuda_stream or 1)
        same(torch.utils.dlpack.from_dlpack(legacy), reference["f32"], "f32 (legacy capsule)")

    @check("dlpack: torch -> cuferry -> torch without a copy")
    def _():
        x = torch.randn(1 << 20, device=cuda)
        c = cuferry.from_dlpack(x)
        assert c.shape == tuple(x.shape) and c.dtype == "f32" and c.device == ordinal
        assert c.to_bytes() == bytes_of(x)
        y = torch.from_dlpack(c)
        assert y.data_ptr() == x.data_ptr(), "not the same memory"
        y.add_(1)
        torch.cuda.synchronize()
        assert torch.equal(x, y)
        del c, y
        x.add_(1)  # x is still torch's
        torch.cuda.synchronize()

    @check("dlpack: cuferry -> torch -> cuferry without a copy")
    def _():
        native = cuferry.load(path, device=ordinal, native=True, select=["i32"])["i32"]
        t = torch.from_dlpack(native)
        back = cuferry.from_dlpack(t)
        assert back.to_bytes() == bytes_of(reference["i32"])

    @check("dlpack: a strided torch tensor comes in as a compact copy")
    def _():
        x = torch.randn(300, 200, device=cuda)
        c = cuferry.from_dlpack(x.t())
        assert c.shape == (200, 300)
        assert c.to_bytes() == bytes_of(x.t().contiguous())

    @check("dlpack: a tensor written on a side stream of torch's is read after the write")
    def _():
        side = torch.cuda.Stream(cuda)
        with torch.cuda.stream(side):
            a = torch.randn(4096, 4096, device=cuda)
            for _ in range(20):
                a = a @ a.t() / 4096.0  # long work on the side stream
            expected_ptr = a.data_ptr()
            c = cuferry.from_dlpack(a)  # asks torch to order its writes before the engine
        side.synchronize()
        assert c.to_bytes() == bytes_of(a)
        assert a.data_ptr() == expected_ptr

    @check("save: torch tensors, read back by safetensors, byte for byte its own file")
    def _():
        out = d / "cuferry.safetensors"
        cuferry.save(out, tensors)
        back = safetensors.torch.load_file(str(out), device=f"cuda:{ordinal}")
        assert set(back) == set(tensors)
        for name, t in back.items():
            same(t, tensors[name], name)
        theirs = d / "theirs.safetensors"
        safetensors.torch.save_file(tensors, str(theirs))
        assert out.read_bytes() == theirs.read_bytes(), "the files differ"
        # Still torch's, untouched.
        for name, t in tensors.items():
            same(t, reference[name], name)

    @check("save: a strided torch tensor is saved as its row-major contents; mixed sources")
    def _():
        x = torch.randn(64, 48, device=cuda)
        native = cuferry.load(path, device=ordinal, native=True, select=["u8"])["u8"]
        out = d / "strided.safetensors"
        cuferry.save(out, {"xt": x.t(), "u8": native})
        back = safetensors.torch.load_file(str(out), device=f"cuda:{ordinal}")
        same(back["xt"], x.t().contiguous(), "xt")
        same(back["u8"], reference["u8"], "u8")
        assert not native.exported

    @check("save: a CPU tensor is refused with ValueError")
    def _():
        try:
            cuferry.save(d / "cpu.safetensors", {"x": torch.ones(3)})
        except ValueError:
            return
        raise AssertionError("no ValueError")

    @check("errors: a malformed file raises cuferry.Error naming it")
    def _():
        bad = d / "bad.safetensors"
        bad.write_bytes(struct.pack("<Q", 1 << 30) + b"{}      ")
        try:
            cuferry.load(bad, device=ordinal)
        except cuferry.Error as e:
            assert "bad.safetensors" in str(e), str(e)
            assert e.kind == "malformed", e.kind
            return
        raise AssertionError("no cuferry.Error")

    if torch.cuda.device_count() > 1:

        @check("load: another device")
        def _():
            other = (ordinal + 1) % torch.cuda.device_count()
            t = cuferry.load(path, device=other, select=["f32"])["f32"]
            assert t.device == torch.device(f"cuda:{other}")
            same(t, reference["f32"].to(f"cuda:{other}"), "f32")

    if args.bench_mib > 0:
        big = d / "bench.safetensors"
        n = args.bench_mib << 20
        parts = {f"layer{i}": torch.randn(n // 4 // 16, device=cuda).to(torch.bfloat16) for i in range(16)}
        safetensors.torch.save_file(parts, str(big))
        del parts
        for f in (lambda: cuferry.load(big, device=ordinal), lambda: safetensors.torch.load_file(str(big), device=f"cuda:{ordinal}")):
            f()  # warm the page cache and both paths
        size = os.path.getsize(big)
        for label, f in (
            ("cuferry.load", lambda: cuferry.load(big, device=ordinal)),
            ("safetensors.torch.load_file", lambda: safetensors.torch.load_file(str(big), device=f"cuda:{ordinal}")),
        ):
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = f()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
                del out
            print(f"bench {label}: {size / best / 2**30:.2f} GiB/s ({size / 2**20:.0f} MiB in {best * 1e3:.0f} ms, best of 3)")

    tmp.cleanup()
    print(f"{RESULTS['passed']} passed, {RESULTS['failed']} failed")
    return 1 if RESULTS["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
