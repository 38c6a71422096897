"""cuferry's Python module on the simulated device (a build with the cargo feature `sim`).

Every test runs the crate's real routes (the loader, the writer, DLPack export and import) on a
deterministic simulated device, so no GPU is needed. They are skipped, with the reason, on a
build without the simulator.
"""

import contextlib
import ctypes
import io
import json
import pathlib
import struct
import tempfile
import threading
import unittest

import support
from support import cuferry

_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def capsule_named(capsule, name):
    return _is_valid(capsule, name.encode()) == 1


try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


class Case(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not support.simulated():
            raise unittest.SkipTest(support.SKIP_NO_SIM)

    def setUp(self):
        self._dir = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self._dir.name)
        self.path = self.dir / "model.safetensors"
        self.expected = support.sample_tensors()
        support.write_safetensors(self.path, self.expected, metadata={"format": "pt"})

    def tearDown(self):
        self._dir.cleanup()

    def load(self, path=None, **kwargs):
        return cuferry.load(self.path if path is None else path, native=True, **kwargs)

    def assertMatches(self, tensors, expected):
        self.assertEqual(set(tensors), set(expected))
        for name, (dtype, shape, raw) in expected.items():
            t = tensors[name]
            self.assertIsInstance(t, cuferry.Tensor)
            self.assertEqual(t.shape, tuple(shape), name)
            self.assertEqual(t.dtype, support.DTYPES[dtype], name)
            self.assertEqual(t.to_bytes(), raw, name)


class Load(Case):
    def test_names_shapes_dtypes_and_bytes_of_every_tensor(self):
        tensors = self.load()
        self.assertMatches(tensors, self.expected)
        t = tensors["w.f32"]
        self.assertEqual((t.device, t.numel, t.nbytes), (0, 6, 24))
        self.assertEqual(t.__dlpack_device__(), (2, 0))
        self.assertEqual(tensors["scalar.f32"].shape, ())
        self.assertEqual(repr(t), "cuferry.Tensor(shape=(2, 3), dtype='f32', device=0)")

    def test_file_order(self):
        self.assertEqual(list(self.load()), list(self.expected))

    @unittest.skipIf(HAVE_TORCH, "torch is installed: load returns torch tensors")
    def test_without_torch_load_returns_cuferry_tensors(self):
        tensors = cuferry.load(self.path)
        self.assertMatches(tensors, self.expected)

    def test_path_like_and_device_forms(self):
        for device in (0, "cuda:0"):
            self.assertEqual(set(self.load(str(self.path), device=device)), set(self.expected))
        tensors = self.load(device=1)
        self.assertEqual(tensors["w.f32"].device, 1)
        self.assertEqual(tensors["w.f32"].__dlpack_device__(), (2, 1))
        self.assertEqual(tensors["w.f32"].to_bytes(), self.expected["w.f32"][2])

    def test_bad_device_arguments(self):
        with self.assertRaises(ValueError):
            self.load(device=-1)
        with self.assertRaises(ValueError):
            self.load(device="cpu")
        with self.assertRaises(TypeError):
            self.load(device=True)
        with self.assertRaises(TypeError):
            self.load(device=1.0)

    def test_select_by_names(self):
        for select in (["w.f32", "idx.i64"], {"w.f32", "idx.i64"}, iter(["w.f32", "idx.i64"])):
            tensors = self.load(select=select)
            self.assertEqual(list(tensors), ["w.f32", "idx.i64"])
            self.assertEqual(tensors["idx.i64"].to_bytes(), support.i64_bytes(support.I64))
        self.assertEqual(self.load(select=[]), {})
        self.assertEqual(list(self.load(select=["nope", "b.bf16"])), ["b.bf16"])

    def test_select_by_callable(self):
        asked = []

        def select(name):
            asked.append(name)
            return name.endswith(".f32")

        tensors = self.load(select=select)
        self.assertEqual(list(tensors), ["w.f32", "scalar.f32", "empty.f32"])
        self.assertEqual(sorted(asked), sorted(self.expected))

    def test_select_refuses_a_string_and_other_types(self):
        with self.assertRaises(TypeError):
            self.load(select="w.f32")
        with self.assertRaises(TypeError):
            self.load(select=42)
        with self.assertRaises(TypeError):
            self.load(select=[1, 2])

    def test_an_exception_in_select_is_raised(self):
        def select(name):
            raise KeyError(name)

        with self.assertRaises(KeyError):
            self.load(select=select)

    def test_progress_callable_counts_the_selected_bytes(self):
        calls = []
        self.load(select=["w.f32", "b.bf16"], progress=lambda d, t: calls.append((d, t)))
        self.assertTrue(calls)
        self.assertEqual(calls[-1], (24 + 12, 24 + 12))
        dones = [d for d, _ in calls]
        self.assertEqual(dones, sorted(dones))
        self.assertTrue(all(t == 36 for _, t in calls))

    def test_progress_true_prints_one_line_to_stderr(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.load(progress=True)
        text = err.getvalue()
        self.assertIn("cuferry: loaded", text)
        self.assertIn("(100%)", text)
        self.assertTrue(text.endswith("\n"))
        self.assertEqual(text.count("\n"), 1)

    def test_progress_false_and_bad(self):
        self.load(progress=False)
        self.load(progress=None)
        with self.assertRaises(TypeError):
            self.load(progress="yes")

    def test_an_exception_in_progress_is_raised(self):
        def progress(done, total):
            raise ZeroDivisionError("stop")

        with self.assertRaises(ZeroDivisionError):
            self.load(progress=progress)

    def test_a_callback_that_calls_cuferry_raises_usage_error(self):
        def progress(done, total):
            cuferry.load(self.path, native=True)

        with self.assertRaises(cuferry.UsageError) as raised:
            self.load(progress=progress)
        self.assertIn("callback", str(raised.exception))
        self.assertIsInstance(raised.exception, ValueError)
        self.assertEqual(raised.exception.kind, "usage")
        # The engine is free again.
        self.assertEqual(set(self.load()), set(self.expected))

    def test_sharded_index(self):
        tensors = dict(self.expected)
        first = {k: tensors[k] for k in ("w.f32", "b.bf16", "scalar.f32")}
        second = {k: tensors[k] for k in ("idx.i64", "mask.bool", "empty.f32")}
        index = support.write_sharded(
            self.dir,
            {
                "model-00001-of-00002.safetensors": first,
                "model-00002-of-00002.safetensors": second,
            },
        )
        loaded = self.load(index)
        self.assertMatches(loaded, self.expected)
        calls = []
        picked = self.load(
            index, select=["b.bf16", "mask.bool"], progress=lambda d, t: calls.append((d, t))
        )
        self.assertMatches(picked, {k: tensors[k] for k in ("b.bf16", "mask.bool")})
        self.assertEqual(calls[-1], (12 + 6, 12 + 6))

    def test_loads_from_several_threads(self):
        results, errors = [], []

        def work(device):
            try:
                for _ in range(5):
                    tensors = self.load(device=device)
                    results.append({n: t.to_bytes() for n, t in tensors.items()})
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i % 2,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(len(results), 20)
        for got in results:
            self.assertEqual(got, {n: raw for n, (_, _, raw) in self.expected.items()})

    def test_sharded_index_naming_a_missing_shard(self):
        index = self.dir / "broken.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": {"w": "absent.safetensors"}}))
        with self.assertRaises(cuferry.Error) as raised:
            self.load(index)
        self.assertIn("absent.safetensors", str(raised.exception))


class Errors(Case):
    def test_missing_file(self):
        missing = self.dir / "missing.safetensors"
        with self.assertRaises(cuferry.Error) as raised:
            self.load(missing)
        self.assertIn(str(missing), str(raised.exception))
        self.assertEqual(raised.exception.kind, "io")
        self.assertIsInstance(raised.exception, RuntimeError)

    def test_header_length_past_the_end_names_the_file(self):
        bad = self.dir / "bad.safetensors"
        bad.write_bytes(struct.pack("<Q", 1 << 20) + b"{}      ")
        with self.assertRaises(cuferry.Error) as raised:
            self.load(bad)
        self.assertIn("bad.safetensors", str(raised.exception))
        self.assertEqual(raised.exception.kind, "malformed")

    def test_bad_json_names_the_file(self):
        bad = self.dir / "json.safetensors"
        text = b"{not json"
        bad.write_bytes(struct.pack("<Q", len(text)) + text)
        with self.assertRaises(cuferry.Error) as raised:
            self.load(bad)
        self.assertIn("json.safetensors", str(raised.exception))
        self.assertEqual(raised.exception.kind, "malformed")

    def test_a_bad_tensor_entry_names_the_file_and_the_tensor(self):
        bad = self.dir / "short.safetensors"
        for entry in (
            {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]},  # 16 bytes in 12
            {"dtype": "Q99", "shape": [4], "data_offsets": [0, 16]},  # no such type
        ):
            text = json.dumps({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
                               "w": dict(entry, data_offsets=[8, 8 + entry["data_offsets"][1]])})
            text = text.encode() + b" " * (-len(text) % 8)
            bad.write_bytes(struct.pack("<Q", len(text)) + text + b"\x01" * 32)
            with self.assertRaises(cuferry.Error) as raised:
                self.load(bad)
            message = str(raised.exception)
            self.assertTrue(message.startswith(f"{bad}: bad header at tensor 'w': "), message)
            self.assertEqual(raised.exception.kind, "malformed")

    def test_a_file_shorter_than_its_header_says(self):
        bad = self.dir / "short.safetensors"
        text = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})
        text = text.encode() + b" " * (-len(text) % 8)
        bad.write_bytes(struct.pack("<Q", len(text)) + text + b"\x01" * 8)
        with self.assertRaises(cuferry.Error) as raised:
            self.load(bad)
        self.assertIn("short.safetensors", str(raised.exception))

    def test_a_bool_byte_other_than_0_or_1(self):
        bad = self.dir / "bool.safetensors"
        support.write_safetensors(bad, {"m": ("BOOL", [2], b"\x01\x07")})
        with self.assertRaises(cuferry.Error) as raised:
            self.load(bad)
        self.assertIn("bool.safetensors", str(raised.exception))


class DLPack(Case):
    def test_a_second_export_raises_buffer_error(self):
        t = self.load()["w.f32"]
        capsule = t.__dlpack__()
        self.assertTrue(capsule_named(capsule, "dltensor"))
        self.assertTrue(t.exported)
        with self.assertRaises(BufferError):
            t.__dlpack__()
        with self.assertRaises(BufferError):
            t.to_bytes()
        # The metadata stays.
        self.assertEqual((t.shape, t.dtype, t.device), ((2, 3), "f32", 0))
        self.assertIn("exported", repr(t))
        # Dropping a capsule no one took releases the tensor through its destructor.
        del capsule

    def test_capsule_names_follow_max_version(self):
        tensors = self.load()
        self.assertTrue(capsule_named(tensors["w.f32"].__dlpack__(max_version=(1, 0)), "dltensor_versioned"))
        self.assertTrue(capsule_named(tensors["b.bf16"].__dlpack__(max_version=(1, 3)), "dltensor_versioned"))
        self.assertTrue(capsule_named(tensors["idx.i64"].__dlpack__(max_version=(0, 8)), "dltensor"))
        self.assertTrue(capsule_named(tensors["mask.bool"].__dlpack__(max_version=None), "dltensor"))

    def test_stream_arguments(self):
        tensors = self.load()
        for name, stream in (("w.f32", None), ("b.bf16", -1), ("idx.i64", 1), ("mask.bool", 2)):
            self.assertTrue(capsule_named(tensors[name].__dlpack__(stream=stream), "dltensor"), name)
        t = tensors["scalar.f32"]
        with self.assertRaises(ValueError):
            t.__dlpack__(stream=0)
        with self.assertRaises(ValueError):
            t.__dlpack__(stream=-5)
        with self.assertRaises(TypeError):
            t.__dlpack__(stream="default")
        with self.assertRaises(TypeError):
            t.__dlpack__(stream=True)
        with self.assertRaises(TypeError):
            t.__dlpack__(max_version="1.0")
        with self.assertRaises(TypeError):
            t.__dlpack__(None)  # keyword-only, as the array API says
        self.assertFalse(t.exported, "a refused call leaves the tensor")

    def test_dl_device_and_copy(self):
        tensors = self.load()
        t = tensors["w.f32"]
        with self.assertRaises(BufferError):
            t.__dlpack__(dl_device=(1, 0))
        with self.assertRaises(BufferError):
            t.__dlpack__(dl_device=(2, 1))
        with self.assertRaises(BufferError):
            t.__dlpack__(copy=True)
        self.assertFalse(t.exported)
        self.assertTrue(capsule_named(t.__dlpack__(dl_device=(2, 0), copy=False), "dltensor"))

    def test_round_trip_through_our_own_producer_and_consumer(self):
        tensors = self.load()
        for name, (dtype, shape, raw) in self.expected.items():
            original = tensors[name]
            back = cuferry.from_dlpack(original)
            self.assertTrue(original.exported, name)
            self.assertFalse(back.exported, name)
            self.assertEqual(back.shape, tuple(shape), name)
            self.assertEqual(back.dtype, support.DTYPES[dtype], name)
            self.assertEqual(back.to_bytes(), raw, name)
            # An imported tensor exports like any other.
            self.assertTrue(capsule_named(back.__dlpack__(max_version=(1, 0)), "dltensor_versioned"))

    def test_a_tensor_comes_back_again_and_again(self):
        # cuferry -> cuferry -> cuferry: the first import lives on inside the capsule of its
        # export, where nothing reaches it, so the next import of the same bytes is admitted.
        t = self.load()["w.f32"]
        expected = t.to_bytes()
        for _ in range(3):
            t = cuferry.from_dlpack(t)
        self.assertEqual(t.to_bytes(), expected)

    def test_from_dlpack_on_another_device(self):
        t = self.load(device=1)["w.f32"]
        self.assertEqual(cuferry.from_dlpack(t).device, 1)
        other = self.load(device=1)["w.f32"]
        with self.assertRaises(ValueError):
            cuferry.from_dlpack(other, device=0)
        self.assertFalse(other.exported)

    def test_the_consumer_passes_the_engine_stream_and_renames_the_capsule(self):
        t = self.load()["w.f32"]
        producer = Producer(t)
        back = cuferry.from_dlpack(producer)
        (kwargs,) = producer.calls
        self.assertEqual(kwargs["max_version"], (1, 0))
        self.assertIsInstance(kwargs["stream"], int)
        self.assertNotIn(kwargs["stream"], (0, -1))
        self.assertTrue(capsule_named(producer.capsules[0], "used_dltensor_versioned"))
        self.assertEqual(back.to_bytes(), self.expected["w.f32"][2])

    def test_a_producer_without_max_version(self):
        t = self.load()["idx.i64"]
        producer = LegacyProducer(t)
        back = cuferry.from_dlpack(producer)
        self.assertEqual(len(producer.calls), 1)
        self.assertTrue(capsule_named(producer.capsules[0], "used_dltensor"))
        self.assertEqual(back.to_bytes(), self.expected["idx.i64"][2])

    def test_from_dlpack_refusals(self):
        with self.assertRaises(TypeError):
            cuferry.from_dlpack(b"bytes")
        with self.assertRaises(ValueError):
            cuferry.from_dlpack(OnCpu())
        with self.assertRaises(TypeError):
            cuferry.from_dlpack(Returns(object()))
        capsule = self.load()["w.f32"].__dlpack__()
        first = cuferry.from_dlpack(Returns(capsule))
        self.assertTrue(capsule_named(capsule, "used_dltensor"))
        # A capsule a consumer took already is refused, and stays the first consumer's.
        with self.assertRaises(BufferError):
            cuferry.from_dlpack(Returns(capsule))
        self.assertEqual(first.to_bytes(), self.expected["w.f32"][2])


class Save(Case):
    def test_save_then_load_gives_the_same_bytes(self):
        tensors = self.load()
        out = self.dir / "saved.safetensors"
        cuferry.save(out, tensors)
        self.assertMatches(self.load(out), self.expected)
        # The tensors saved are still ours.
        self.assertEqual(tensors["w.f32"].to_bytes(), self.expected["w.f32"][2])
        on_disk, _ = support.read_safetensors(out)
        self.assertEqual(on_disk, {k: (d, s, r) for k, (d, s, r) in self.expected.items()})

    def test_save_of_other_producers_tensors(self):
        tensors = self.load()
        wrapped = {name: Producer(t) for name, t in tensors.items()}
        wrapped["legacy"] = LegacyProducer(self.load(select=["b.bf16"])["b.bf16"])
        out = self.dir / "theirs.safetensors"
        cuferry.save(out, wrapped)
        expected = dict(self.expected)
        expected["legacy"] = self.expected["b.bf16"]
        self.assertMatches(self.load(out), expected)
        for name, producer in wrapped.items():
            self.assertEqual(len(producer.calls), 1, name)
            self.assertIsInstance(producer.calls[0]["stream"], int)

    def test_save_of_imported_tensors(self):
        imported = {n: cuferry.from_dlpack(t) for n, t in self.load().items()}
        out = self.dir / "imported.safetensors"
        cuferry.save(out, imported)
        self.assertMatches(self.load(out), self.expected)

    def test_empty_save(self):
        out = self.dir / "empty.safetensors"
        cuferry.save(out, {})
        self.assertEqual(self.load(out), {})

    def test_save_refusals(self):
        tensors = self.load()
        out = self.dir / "refused.safetensors"
        with self.assertRaises(TypeError):
            cuferry.save(out, [("w", tensors["w.f32"])])
        with self.assertRaises(TypeError):
            cuferry.save(out, {1: tensors["w.f32"]})
        with self.assertRaises(TypeError):
            cuferry.save(out, {"w": b"bytes"})
        with self.assertRaises(ValueError):
            cuferry.save(out, {"w": OnCpu()})
        other = self.load(device=1)["w.f32"]
        with self.assertRaises(ValueError):
            cuferry.save(out, {"a": tensors["w.f32"], "b": other})
        with self.assertRaises(cuferry.Error) as raised:
            cuferry.save(out, {"__metadata__": tensors["w.f32"]})
        self.assertIn("__metadata__", str(raised.exception))
        tensors["b.bf16"].__dlpack__()
        with self.assertRaises(BufferError):
            cuferry.save(out, {"b": tensors["b.bf16"]})
        self.assertFalse(out.exists())
        with self.assertRaises(cuferry.Error) as raised:
            cuferry.save(self.dir / "no" / "such" / "dir.safetensors", {"w": tensors["w.f32"]})
        self.assertEqual(raised.exception.kind, "io")


class Producer:
    """Another library's tensor: delegates the protocol, and records the calls."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.calls = []
        self.capsules = []

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version})
        capsule = self.tensor.__dlpack__(stream=stream, max_version=max_version)
        self.capsules.append(capsule)
        return capsule


class LegacyProducer(Producer):
    """A producer older than DLPack 1.0: `__dlpack__` has no `max_version`."""

    def __dlpack__(self, *, stream=None):
        self.calls.append({"stream": stream})
        capsule = self.tensor.__dlpack__(stream=stream)
        self.capsules.append(capsule)
        return capsule


class OnCpu:
    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        raise AssertionError("not asked")


class Returns:
    """A producer on CUDA device 0 that returns whatever it was given."""

    def __init__(self, value):
        self.value = value

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):
        return self.value


if __name__ == "__main__":
    unittest.main()
