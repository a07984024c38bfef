import pathlib
import subprocess
import sys

HOST_MODULES = ["jaxinfer", "jaxinfer.sampling_params", "jaxinfer.request", "jaxinfer.sched",
                "jaxinfer.sched.page_pool", "jaxinfer.sched.page_table", "jaxinfer.sched.scheduler",
                "jaxinfer.sched.step_input", "jaxinfer.sched.step_buffer", "jaxinfer.sched.buckets",
                "jaxinfer.sched.spec_policy", "jaxinfer.sched.stats", "jaxinfer.sched.output"]


def test_host_modules_do_not_import_jax():
    code = (f"import sys, importlib\nfor m in {HOST_MODULES!r}: importlib.import_module(m)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]\n"
            "assert not bad, bad\n")
    root = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
