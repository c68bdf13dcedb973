"""Every notebook in notebooks/ runs top to bottom on the dtorch kernel, with no error output.

The notebooks assert the values the seeds give in their own cells, so a wrong value is a cell
error here. The kernelspec is installed into a temporary prefix and found through
JUPYTER_PATH; each notebook gets its own kernel and embedded 4-rank cluster.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def dtorch_kernelspec(tmp_path_factory):
    """`python -m dtorch_kernel install --prefix TMP`, and JUPYTER_PATH pointing there."""
    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    subprocess.run([sys.executable, "-m", "dtorch_kernel", "install", "--prefix", str(prefix)],
                   check=True, capture_output=True, text=True, timeout=120)
    data = prefix / "share" / "jupyter"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(data))
        mp.setenv("DTORCH_WORKERS", "4")
        yield data


def summaries(cell) -> list[dict]:
    """The dtorch per-cell collective summaries among a cell's outputs (their metadata)."""
    return [o["metadata"]["dtorch"] for o in cell.get("outputs", [])
            if o.get("output_type") == "display_data"
            and o.get("metadata", {}).get("dtorch", {}).get("cell_collectives")]


def stdout_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def test_the_four_seed_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    for prefix in ("01_", "02_", "03_", "04_"):
        assert any(n.startswith(prefix) for n in names), names


def notebook_references(text: str) -> set[str]:
    """Every ``.ipynb`` file name in ``text`` (markdown links, backticked names, bare names).

    >>> sorted(notebook_references("Next: [a](02_x.ipynb) or `03_y.ipynb`, see 04_z.ipynb."))
    ['02_x.ipynb', '03_y.ipynb', '04_z.ipynb']
    """
    return set(re.findall(r"[\w./-]*\.ipynb", text))


def test_notebook_links_name_existing_files():
    names = {p.name for p in NOTEBOOKS}
    found = {}
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            for ref in notebook_references("".join(cell["source"])):
                found.setdefault(ref, []).append(path.name)
    for doc in (ROOT / "docs" / "jupyter.md", ROOT / "README.md"):
        for ref in notebook_references(doc.read_text()):
            found.setdefault(ref, []).append(doc.name)
    missing = {ref: where for ref, where in found.items()  # a name, or a path from the root
               if not (ROOT / "notebooks" / ref).is_file() and ref not in names
               and not (ROOT / ref).is_file()}
    assert not missing, f"references to notebooks that do not exist: {missing}"
    # the "Next:" links are real markdown links, so they can be clicked in JupyterLab
    assert {"02_collectives.ipynb", "03_partial_and_matmul.ipynb"} <= set(found)
    for src, dst in (("01_", "02_collectives.ipynb"), ("02_", "03_partial_and_matmul.ipynb")):
        nb, = [p for p in NOTEBOOKS if p.name.startswith(src)]
        assert f"]({dst})" in nb.read_text(), (nb.name, dst)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_clean(path, dtorch_kernelspec):
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "dtorch"
    client = nbclient.NotebookClient(nb, kernel_name="dtorch", timeout=240, startup_timeout=120,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell (or assertion)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    for c in code:
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                assert "Traceback" not in o["text"] and "Error" not in o["text"], o["text"]
    assert all(c.get("execution_count") for c in code), "every code cell ran"
    # the kernel started the cluster lazily, with its progress display, in one cell
    ready = [o for c in code for o in c.get("outputs", [])
             if "ranks ready in" in str(o.get("data", {}).get("text/plain", ""))]
    assert len(ready) == (2 if path.name.startswith("07_") else 1)  # 07 restarts once
    # each notebook moves data somewhere, and the kernel said so under that cell
    assert any(summaries(c) for c in code)
    if path.name.startswith("02_"):
        check_collectives_notebook(code)


def check_collectives_notebook(code):
    """Seed 002's table, counted live: a summary exactly under the cells that moved data."""
    expect = {"Shard(0) -> Replicate :": {"all_gather": 1},
              "Replicate -> Shard(0) :": None,
              "Shard(0) -> Shard(1)  :": {"all_to_all": 1},
              "Partial -> Replicate :": {"all_reduce": 1},
              "Partial -> Shard(0)  :": {"reduce_scatter": 1},
              "Replicate -> Partial, Shard(1) -> Shard(1):": None}
    for marker, counts in expect.items():
        cell, = [c for c in code if marker in stdout_of(c)]
        got = summaries(cell)
        if counts is None:
            assert got == [], marker
        else:
            assert [s["counts"] for s in got] == [counts], marker
