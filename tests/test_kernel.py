"""The dtorch Jupyter kernel, driven through jupyter_client like a notebook frontend.

One kernel (with its embedded 4-rank cluster) serves the whole module; its kernelspec is
installed by ``python -m dtorch_kernel install --prefix TMP`` and found through JUPYTER_PATH.
Tests that need tensors run an idempotent setup cell first, so any one of them can run alone.
"""

import json
import re
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

from dtorch_kernel import install as kinstall  # noqa: E402
from dtorch_kernel.summary import summary_text  # noqa: E402
from dtorch.runtime import testing  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SETUP = """
import torch, dtorch
from dtorch import init_device_mesh, Shard, Replicate, Partial
mesh = init_device_mesh("cpu", 4)
x = dtorch.tensor(torch.arange(16.).reshape(4, 4), device_mesh=mesh, placements=[Shard(0)])
"""

COMPLEX_MAX = """
bad = dtorch.from_local([torch.ones(2, dtype=torch.complex64)] * 4, mesh, [Partial("max")])
bad = bad.redistribute(placements=[Replicate()])
"""


# ------------------------------------------------------------------------------------------
# driving the kernel
# ------------------------------------------------------------------------------------------
# the per-row ", predicted 1.2 ms, measured 1.5 ms" and the cell's "; comm predicted ..." total
TIMING = re.compile(r", (?:predicted|measured) (?:\?|[\d.]+ (?:us|ms|s))|"
                    r"; comm (?:predicted|measured) [^;]*?(?=;|$)")


def untimed(text: str) -> str:
    """A summary line without its times (they vary run to run; counts and bytes do not).

    >>> untimed("dtorch: all_gather x1 (dim 0, 16 B/rank, predicted 1.2 ms, measured 950 us)")
    'dtorch: all_gather x1 (dim 0, 16 B/rank)'
    """
    return TIMING.sub("", text)


class Cell(SimpleNamespace):
    """One executed cell: ``status``, ``reply`` content, ``outputs`` [(msg_type, content)]."""

    @property
    def errors(self):
        return [c for t, c in self.outputs if t == "error"]

    def stream(self, name="stdout") -> str:
        return "".join(c["text"] for t, c in self.outputs if t == "stream" and c["name"] == name)

    @property
    def summaries(self):
        """The per-cell collective summaries: (text/plain without times, metadata) pairs."""
        return [(untimed(t), meta) for t, meta in self.timed_summaries]

    @property
    def timed_summaries(self):
        """The per-cell collective summaries as shown: (text/plain, metadata) pairs."""
        return [(c["data"].get("text/plain", ""), c["metadata"]["dtorch"])
                for t, c in self.outputs if t == "display_data"
                and c.get("metadata", {}).get("dtorch", {}).get("cell_collectives")]

    def texts(self):
        return [c.get("data", {}).get("text/plain", "") for t, c in self.outputs
                if t in ("display_data", "update_display_data", "execute_result")]

    @property
    def result(self):
        return "".join(c["data"]["text/plain"] for t, c in self.outputs if t == "execute_result")


class Kernel:
    def __init__(self, km, kc):
        self.km, self.kc = km, kc

    def run(self, code: str, timeout: float = 180) -> Cell:
        outputs = []

        def hook(msg):
            if msg["msg_type"] in ("stream", "display_data", "update_display_data",
                                   "execute_result", "error"):
                outputs.append((msg["msg_type"], msg["content"]))

        reply = self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        return Cell(status=reply["content"]["status"], reply=reply["content"], outputs=outputs)

    def ok(self, code: str, timeout: float = 180) -> Cell:
        cell = self.run(code, timeout)
        assert cell.status == "ok", (code, cell.errors)
        return cell


@pytest.fixture(scope="module")
def kernelspec_dir(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    out = subprocess.run([sys.executable, "-m", "dtorch_kernel", "install", "--prefix",
                          str(prefix)], check=True, capture_output=True, text=True, timeout=120)
    assert "Installed kernelspec dtorch" in out.stdout
    return prefix / "share" / "jupyter"


@pytest.fixture(scope="module")
def kernel(kernelspec_dir):
    """A started dtorch kernel; ``kernel.startup`` records the first cells (lazy start)."""
    from jupyter_client import KernelManager
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(kernelspec_dir))
        mp.setenv("DTORCH_WORKERS", "4")
        km = KernelManager(kernel_name="dtorch")
        km.shutdown_wait_time = 30  # let the kernel shut its cluster down politely
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=120)
            k = Kernel(km, kc)
            k.startup = SimpleNamespace(
                imported=k.ok("import dtorch\nfrom dtorch.runtime import session\n"
                              "session.is_running()"),
                status=k.ok("%dtorch status"),
                first=k.ok(SETUP))
            yield k
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)


# ------------------------------------------------------------------------------------------
# install
# ------------------------------------------------------------------------------------------
def test_kernelspec_installed_into_prefix(kernelspec_dir):
    spec = json.loads((kernelspec_dir / "kernels" / "dtorch" / "kernel.json").read_text())
    assert "dtorch" in spec["display_name"]
    assert spec["argv"][:3] == [sys.executable, "-m", "dtorch_kernel"]
    assert "{connection_file}" in spec["argv"] and spec["language"] == "python"
    from jupyter_client.kernelspec import KernelSpecManager
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(kernelspec_dir))
        found = KernelSpecManager().get_kernel_spec("dtorch")
    assert found.display_name == spec["display_name"]


def test_install_locations(tmp_path, monkeypatch):
    """--user goes to the Jupyter data dir, --sys-prefix to sys.prefix, --prefix to PATH."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    assert kinstall.main(["--user"]) == 0
    assert (tmp_path / "user" / "kernels" / "dtorch" / "kernel.json").exists()
    assert kinstall.main(["--sys-prefix"]) == 0
    assert (tmp_path / "venv" / "share" / "jupyter" / "kernels" / "dtorch" / "kernel.json").exists()
    assert kinstall.main(["--prefix", str(tmp_path / "p"), "--name", "dt2"]) == 0
    assert (tmp_path / "p" / "share" / "jupyter" / "kernels" / "dt2" / "kernel.json").exists()
    with pytest.raises(SystemExit):
        kinstall.main(["--user", "--sys-prefix"])


# ------------------------------------------------------------------------------------------
# lazy start, per-cell summary
# ------------------------------------------------------------------------------------------
def test_cluster_starts_lazily_with_a_progress_display(kernel):
    s = kernel.startup
    assert s.imported.result == "False"  # importing dtorch starts nothing
    assert "no cluster running" in "".join(s.status.texts())
    texts = s.first.texts()
    assert any("starting 4 local workers" in t for t in texts)
    assert any("4 ranks ready in" in t for t in texts)
    assert s.first.summaries == []  # sending shards is not a collective


def test_summary_appears_exactly_when_a_cell_moves_data(kernel):
    kernel.ok(SETUP)
    assert kernel.ok("1 + 1").summaries == []
    cell = kernel.ok("r = x.redistribute(placements=[Replicate()])")
    (text, meta), = cell.summaries
    assert text == "dtorch: all_gather x1 (dim 0, 16 B/rank)"
    assert meta["counts"] == {"all_gather": 1}
    # Replicate -> Shard keeps a slice; reading Shard/Replicate values is not a collective
    assert kernel.ok("s = r.redistribute(placements=[Shard(0)])").summaries == []
    assert kernel.ok("r.to_torch()[1].tolist(), x.to_torch()[2].tolist()").summaries == []
    assert kernel.ok("x.local_shapes()").summaries == []


def test_summary_shows_predicted_and_measured_time_and_explain_names_the_source(kernel):
    """Each row carries the cost model's prediction and the ranks' measured time; the cell's
    metadata has both totals; ``%dtorch explain`` names what issued each collective."""
    kernel.ok(SETUP)
    cell = kernel.ok("big = dtorch.randn(512, 512, device_mesh=mesh, placements=[Shard(0)])\n"
                     "r = big.redistribute(placements=[Replicate()])\n"
                     "q = big.redistribute(placements=[Shard(1)])")
    (text, meta), = cell.timed_summaries
    assert re.search(r"all_gather x1 \(dim 0, 256.0 KiB/rank, predicted [\d.]+ (us|ms), "
                     r"measured [\d.]+ (us|ms)\)", text), text
    assert "; comm predicted" in text
    timing = meta["timing"]
    assert timing["predicted_s"] > 0 and timing["measured_s"] > 0
    assert set(timing["measured"]) == {"all_gather 0", "all_to_all 0"}
    out = kernel.ok("%dtorch explain").stream()
    assert "2 collectives in the last cell" in out
    assert re.search(r"redistribute \[S\(0\)\] -> \[R\]: all_gather x1 on 0, 256.0 KiB/rank, "
                     r"predicted [\d.]+ (us|ms)", out), out
    assert "redistribute [S(0)] -> [S(1)]: all_to_all x1" in out
    assert "measured on the ranks (slowest rank): all_gather on 0" in out
    # with counts off nothing is shown or read; back on, the time is this cell's only
    kernel.ok("%dtorch counts off")
    assert kernel.ok("r2 = big.redistribute(placements=[Replicate()])").summaries == []
    kernel.ok("%dtorch counts on")
    (text, meta), = kernel.ok("r3 = big.redistribute(placements=[Replicate()])").timed_summaries
    assert "measured" in text and set(meta["timing"]["measured"]) == {"all_gather 0"}


def test_summary_shows_constant_bytes_once(kernel):
    """A plain tensor beside a DTensor is sent once as a constant (dtorch.ops.constants): the
    cell that sends it says so; the same constant again sends nothing and shows nothing."""
    kernel.ok(SETUP)
    kernel.ok("dtorch.clear_constants()\nmask = torch.ones(4, 4)")
    (text, meta), = kernel.ok("y = x + mask").summaries
    assert text == "dtorch: constants sent x1 (from the controller, 64 B/rank)"
    assert meta["counts"] == {} and meta["constants"] == {"sends": 1, "bytes_per_rank": 64}
    assert kernel.ok("y = x + mask").summaries == []
    assert kernel.ok("y.to_torch()[0].tolist()").result == "[1.0, 2.0, 3.0, 4.0]"


def test_summary_names_every_kind_with_counts_dims_and_bytes(kernel):
    kernel.ok(SETUP)
    cell = kernel.ok("""
p = dtorch.from_local([torch.full((4, 4), float(i)) for i in range(4)], mesh, [Partial()])
a = p.redistribute(placements=[Replicate()])
b = p.redistribute(placements=[Shard(0)])
c = x.redistribute(placements=[Shard(1)])
d = x.redistribute(placements=[Replicate()])
e = x.redistribute(placements=[Replicate()])
""")
    (text, meta), = cell.summaries
    assert meta["counts"] == {"all_reduce": 1, "reduce_scatter": 1, "all_to_all": 1,
                              "all_gather": 2}
    assert text == ("dtorch: 5 collectives: all_reduce x1 (dim 0, 64 B/rank); reduce_scatter x1 "
                    "(dim 0, 64 B/rank); all_to_all x1 (dim 0, 16 B/rank); all_gather x2 "
                    "(dim 0, 32 B/rank)")
    assert kernel.ok("a.to_local(3)[0].tolist()").result == "[6.0, 6.0, 6.0, 6.0]"
    # reading a Partial's value reduces it: one all_reduce, shown under that cell
    cell = kernel.ok("p.full_tensor()[0].tolist()")
    assert cell.result == "[6.0, 6.0, 6.0, 6.0]"
    assert [t for t, _ in cell.summaries] == ["dtorch: all_reduce x1 (dim 0, 64 B/rank)"]


def test_summary_names_mesh_dims(kernel):
    kernel.ok(SETUP)
    cell = kernel.ok("""
m2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
t = dtorch.tensor(torch.arange(16.).reshape(4, 4), device_mesh=m2, placements=[Shard(0), Shard(1)])
u = t.redistribute(placements=[Shard(0), Replicate()])
""")
    (text, meta), = cell.summaries
    assert text == "dtorch: all_gather x1 (dim tp, 16 B/rank)"
    assert meta["rows"] == [["all_gather", "dim tp", 1, 16]]
    html = [c["data"]["text/html"] for t, c in cell.outputs if t == "display_data"
            and c.get("metadata", {}).get("dtorch")]
    assert "all_gather" in html[0] and "tp" in html[0]


# ------------------------------------------------------------------------------------------
# errors, output, interrupts
# ------------------------------------------------------------------------------------------
def test_worker_error_is_the_cells_error_and_the_next_cell_works(kernel):
    kernel.ok(SETUP)
    cell = kernel.run(COMPLEX_MAX)
    assert cell.status == "error"
    assert cell.reply["ename"] == "RemoteError"
    assert "does not support" in cell.reply["evalue"] and "complex" in cell.reply["evalue"]
    err, = cell.errors
    assert err["ename"] == "RemoteError" and "remote traceback" in err["evalue"]
    assert [m["counts"] for _, m in cell.summaries] == [{"all_reduce": 1}]
    # reading the failed tensor in the cell raises it there; the end-of-cell wait, which
    # hears of the same failure, does not report it a second time
    cell = kernel.run(COMPLEX_MAX + "bad.to_torch()")
    assert cell.status == "error" and cell.reply["ename"] == "RemoteError"
    assert len(cell.errors) == 1 and "also reported" not in cell.stream("stderr")
    # a cell failing for its own reason still hears about the ranks' failure
    cell = kernel.run(COMPLEX_MAX + "undefined_name")
    assert cell.reply["ename"] == "NameError"
    assert "dtorch: the ranks also reported: RemoteError" in cell.stream("stderr")
    nxt = kernel.run("x.redistribute(placements=[Replicate()]).to_local(2)[1].tolist()")
    assert nxt.status == "ok" and nxt.errors == []  # the error is reported once, in its cell
    assert nxt.result == "[4.0, 5.0, 6.0, 7.0]"


def test_worker_stdout_and_stderr_reach_the_cell(kernel):
    kernel.ok(SETUP)
    cell = kernel.ok("""
import warnings
from dtorch.runtime import session, messages as m
c = session.get_controller()
c.issue(m.Call((), print, ("hello from a rank",), {}, (0, 1, 2, 3)))
c.issue(m.Call((), warnings.warn, ("careful up there",), {}, (0, 1, 2, 3)))
""")
    out, err = cell.stream("stdout"), cell.stream("stderr")
    for rank in range(4):
        assert f"[rank {rank}] hello from a rank\n" in out
        assert f"[rank {rank}] " in err
    assert "UserWarning: careful up there" in err


STILL_HELD = "all(s['running'] == 'Call(hold_rank)' for s in dtorch.rank_stats())"
HOLD = ("from dtorch.runtime import session, messages as m, testing\n"
        "session.get_controller().issue(m.Call((), testing.hold_rank, ({folder!r},), {{}}, "
        "(0, 1, 2, 3)))\n")


def interrupt_once_held(kernel, folder) -> threading.Thread:
    """Interrupt the kernel as soon as all 4 ranks are inside ``hold_rank`` (an event, not a
    guess at how long delivery takes on a loaded machine)."""
    def interrupt():
        try:
            testing.wait_until_held(str(folder), 4)
        finally:
            kernel.km.interrupt_kernel()
    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    return thread


def test_interrupt_returns_promptly_and_the_cluster_stays_consistent(kernel, tmp_path):
    kernel.ok(SETUP)
    thread = interrupt_once_held(kernel, tmp_path)
    try:
        cell = kernel.run(HOLD.format(folder=str(tmp_path)) + "dtorch.synchronize()\n",
                          timeout=100)
        thread.join()
        assert cell.status == "error" and cell.reply["ename"] == "KeyboardInterrupt"
        # control came back while the ranks were still held (not after they went on)
        assert kernel.ok(STILL_HELD, timeout=30).result == "True", \
            "the interrupt waited for the ranks"
    finally:
        testing.release_ranks(str(tmp_path))
    # the ranks survived the SIGINT jupyter sends to the kernel's process group, the stream
    # kept its order: the next cell queues behind the hold and gets the right values
    after = kernel.ok("x.redistribute(placements=[Replicate()]).to_local(3)[3].tolist()")
    assert after.result == "[12.0, 13.0, 14.0, 15.0]"
    assert kernel.ok("session.cluster_info()['ranks'], session.get_controller().closed"
                     ).result == "(4, False)"


def test_interrupt_during_the_end_of_cell_wait(kernel, tmp_path):
    """The cell itself returns at once (the ranks get its work when the cell has ended); the
    kernel's wait for that work is what gets interrupted. A later plain-Python cell does not
    wait for the ranks: they are held until the test releases them, so a cell that waited
    would run into its timeout."""
    kernel.ok(SETUP)
    thread = interrupt_once_held(kernel, tmp_path)
    try:
        cell = kernel.run(HOLD.format(folder=str(tmp_path)), timeout=100)
        thread.join()
        assert cell.status == "error" and cell.reply["ename"] == "KeyboardInterrupt"
        assert "background" in cell.reply["evalue"]
        assert kernel.ok("2 + 2", timeout=30).result == "4"
        assert kernel.ok(STILL_HELD, timeout=30).result == "True", \
            "a cell that ships nothing waited"
    finally:
        testing.release_ranks(str(tmp_path))
    after = kernel.ok("x.redistribute(placements=[Replicate()]).to_local(1)[0].tolist()")
    assert after.result == "[0.0, 1.0, 2.0, 3.0]"


# ------------------------------------------------------------------------------------------
# magics (restart last: it replaces the cluster)
# ------------------------------------------------------------------------------------------
def test_magic_status_and_counts(kernel):
    kernel.ok(SETUP)
    status = "\n".join(kernel.ok("%dtorch status").texts())
    assert "4 ranks running" in status and "gloo" in status
    for rank in range(4):
        assert f"rank {rank}: tls://" in status
    assert "per-cell collective summary: on" in status

    assert "summary off" in kernel.ok("%dtorch counts off").stream()
    assert kernel.ok("q = x.redistribute(placements=[Replicate()])").summaries == []
    assert "summary off" in kernel.ok("%dtorch counts").stream()
    assert "summary on" in kernel.ok("%dtorch counts on").stream()
    (text, _), = kernel.ok("q = x.redistribute(placements=[Replicate()])").summaries
    assert text.startswith("dtorch: all_gather x1")

    bad = kernel.run("%dtorch counts maybe")
    assert bad.status == "error" and bad.reply["ename"] == "UsageError"
    assert "usage: %dtorch" in kernel.ok("%dtorch help").stream() + \
        kernel.run("%dtorch frobnicate").reply["evalue"]


def test_magic_restart(kernel):
    kernel.ok(SETUP)
    kernel.ok("old = x")
    cell = kernel.ok("%dtorch restart", timeout=240)
    assert "restarted: 4 ranks ready" in cell.stream()
    stale = kernel.run("old.to_torch()")
    assert stale.status == "error" and stale.reply["ename"] == "FreedTensorError"
    cell = kernel.ok(SETUP + "x.redistribute(placements=[Replicate()]).to_local(0)[0].tolist()")
    assert cell.result == "[0.0, 1.0, 2.0, 3.0]"
    assert [t for t, _ in cell.summaries] == ["dtorch: all_gather x1 (dim 0, 16 B/rank)"]


# ------------------------------------------------------------------------------------------
# in-process units (no kernel)
# ------------------------------------------------------------------------------------------
def test_kernel_module_doctests():
    """kernel/ is not in pytest's testpaths; run its examples here."""
    import doctest
    from dtorch_kernel import install, progress, summary
    for mod in (summary, install, progress):
        assert doctest.testmod(mod).failed == 0, mod.__name__


def test_summary_text_format():
    from dtorch.comm_debug import CommRecord
    g = ((0, 1, 2, 3),)
    assert summary_text([CommRecord("all_gather", 0, None, g, 256)]) == \
        "dtorch: all_gather x1 (dim 0, 256 B/rank)"
    assert summary_text([]) == ""
