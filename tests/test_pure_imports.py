"""The pure parts import no Dask: the planner, layout math, op rules, cost model and the
widgets' layout/plan logic work in a process with no cluster (DESIGN: dependencies point down).

Mutation that fails it: ``from .cluster import ...`` back at the top of runtime/session.py.
"""

import subprocess
import sys

PURE = ("dtorch", "dtorch.ops", "dtorch.redistribute", "dtorch.layout", "dtorch.cost",
        "dtorch.spec", "dtorch_widgets", "dtorch_widgets.explorer_model",
        "dtorch_widgets.op_model")

CHECK = """
import importlib, sys
for name in {names!r}:
    importlib.import_module(name)
from dtorch import init_device_mesh, Shard, Replicate, plan_redistribute
steps = plan_redistribute(init_device_mesh("cpu", 4), (8, 8), [Shard(0)], [Replicate()])
assert [s.kind for s in steps] == ["all_gather"]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("dask", "distributed"))
print("LOADED", loaded)
"""


def test_pure_modules_import_no_dask():
    names = tuple(n for n in PURE if _exists(n))
    out = subprocess.run([sys.executable, "-c", CHECK.format(names=names)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout


def _exists(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
