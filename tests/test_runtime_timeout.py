"""A collective whose peer never arrives times out (DTORCH_COLLECTIVE_TIMEOUT), instead of
hanging; the ranks then refuse further collectives until restart().

Runs in a fresh Python process: it needs a cluster started with a short timeout.
"""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import time, torch, dtorch
from dtorch import Replicate, Shard, init_device_mesh
from dtorch.runtime import messages as m, session

dtorch.init(n_workers=4)
mesh = init_device_mesh("cpu", 4)
x = dtorch.tensor(torch.arange(8.), device_mesh=mesh, placements=[Shard(0)])
dtorch.synchronize()
c = session.get_controller()
c.issue(m.Call((), time.sleep, (8,), {}, (3,)))  # rank 3 arrives 8 s late
y = x.redistribute(placements=[Replicate()])
start = time.monotonic()
try:
    y.to_torch()
    print("RESULT no error")
except dtorch.RemoteError as err:
    print("RESULT error", round(time.monotonic() - start), "restart()" in str(err))
later = x.redistribute(placements=[Replicate()])  # refused: the ranks may be out of step
try:
    later.to_local(0)
    print("LATER no error")
except dtorch.RemoteError as err:
    print("LATER error", "restart()" in str(err))
try:
    dtorch.synchronize()
except dtorch.RemoteError:
    pass
dtorch.restart()
z = dtorch.tensor(torch.arange(8.), device_mesh=mesh, placements=[Shard(0)])
print("AFTER", z.redistribute(placements=[Replicate()]).to_torch().tolist())
dtorch.shutdown()
"""


@pytest.mark.timeout(180)
def test_collective_timeout_turns_a_late_peer_into_an_error():
    env = dict(os.environ, DTORCH_COLLECTIVE_TIMEOUT="3")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=170, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {l.split()[0]: l.split()[1:] for l in out.stdout.splitlines()
             if l.split() and l.split()[0] in ("RESULT", "LATER", "AFTER")}
    assert lines["RESULT"][0] == "error" and lines["RESULT"][2] == "True", out.stdout
    assert lines["LATER"] == ["error", "True"], out.stdout
    assert " ".join(lines["AFTER"]) == str([float(i) for i in range(8)]), out.stdout
