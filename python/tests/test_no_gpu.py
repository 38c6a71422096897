"""On a machine without a GPU (CI's), the real engine cannot be opened: the error says so.

Each check runs in a fresh interpreter, so that the simulated device the other tests switch to
(in a build with `sim`) is not in the way: there, as in a build without it, `cuferry.load`
opens CUDA. Skipped where a GPU is present.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import unittest

import support
from support import cuferry

HAVE_GPU = bool(shutil.which("nvidia-smi")) or os.path.exists("/dev/nvidia0")

# Runs `call` (an expression over `cuferry` and `path`) and prints the error's kind and message.
SCRIPT = """
import sys
import cuferry
path = sys.argv[1]
try:
    {call}
except cuferry.Error as e:
    print(e.kind)
    print(e)
    sys.exit(0)
sys.exit("no error")
"""


@unittest.skipIf(HAVE_GPU, "a GPU is present")
class NoGpu(unittest.TestCase):
    def run_fresh(self, call):
        package_root = pathlib.Path(cuferry.__file__).resolve().parent.parent
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(package_root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        with tempfile.TemporaryDirectory() as d:
            path = pathlib.Path(d) / "model.safetensors"
            support.write_safetensors(path, support.sample_tensors())
            done = subprocess.run(
                [sys.executable, "-c", SCRIPT.format(call=call), str(path)],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        kind, message = done.stdout.split("\n", 1)
        return kind, message.strip()

    def test_load_raises_error_naming_the_device(self):
        kind, message = self.run_fresh("cuferry.load(path, native=True)")
        self.assertTrue(message.startswith("cannot open CUDA device 0: "), message)
        self.assertTrue("driver" in message or "device" in message.split(": ", 1)[1], message)
        self.assertIn(kind, ("setup", "driver"))

    def test_load_on_another_ordinal_names_it(self):
        kind, message = self.run_fresh("cuferry.load(path, device=3, native=True)")
        self.assertTrue(message.startswith("cannot open CUDA device 3: "), message)

    def test_save_raises_the_same(self):
        kind, message = self.run_fresh("cuferry.save(path + '.out', {})")
        self.assertTrue(message.startswith("cannot open CUDA device 0: "), message)


class Build(unittest.TestCase):
    def test_the_simulator_switch_exists_only_in_a_sim_build(self):
        # `CUFERRY_EXPECT_SIM=0` or `1` states which build is under test; unset, either passes.
        expected = os.environ.get("CUFERRY_EXPECT_SIM")
        if expected is None:
            self.skipTest("CUFERRY_EXPECT_SIM is not set")
        import cuferry._native as native

        self.assertEqual(hasattr(native, "_use_simulator"), expected == "1")


if __name__ == "__main__":
    unittest.main()
