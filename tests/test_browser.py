"""The notebooks in a real JupyterLab, driven by headless Chromium through Playwright.

One JupyterLab server (127.0.0.1, a random port, a token, a temp root holding copies of the
notebooks, the dtorch kernelspec in a temp prefix) serves every notebook in turn. For each
one the browser opens it, clicks *Run → Run All Cells*, waits until every cell ran (or one
failed) and the kernel is idle, then reads the page: no error output, every widget view the
kernel sent drawn as a live widget (no "Error displaying widget"), the kernel's per-cell
collective summaries shown, and each link to the next notebook opening it.

Needs Debian's ``/usr/bin/chromium`` (or ``DTORCH_CHROMIUM``), the ``playwright`` Python
package (no browser download: Playwright drives that Chromium) and ``jupyterlab``; without
them the test skips and says which is missing. ``.ci/run`` installs Chromium (``make test``
the Python packages) and sets ``DTORCH_REQUIRE_BROWSER=1``, which turns the skip into a
failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dtorch.runtime.cluster import free_port

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHROMIUM = Path(os.environ.get("DTORCH_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SUMMARY_TITLE = "dtorch: collectives issued by this cell"
EXPLORER_SHOT = ROOT / "docs" / "images" / "placement_explorer.png"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
STDERR_MIME = "application/vnd.jupyter.stderr"
SETTINGS = {  # JupyterLab user settings: every cell in the DOM, no news or update pop-ups
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"checkForUpdates": False, "fetchNews": "false"},
}


def missing_tools() -> str | None:
    """Why the browser test cannot run here, or None."""
    if not CHROMIUM.is_file():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set DTORCH_CHROMIUM)"
    for module, package in (("playwright", "playwright"), ("jupyterlab", "jupyterlab")):
        if importlib.util.find_spec(module) is None:
            return f"the {package} Python package is not installed (pip install -e '.[test]')"
    return None


MISSING = missing_tools()
REQUIRED = os.environ.get("DTORCH_REQUIRE_BROWSER") == "1"
if MISSING is not None and not REQUIRED:
    pytest.skip(f"browser test skipped: {MISSING}", allow_module_level=True)


@pytest.fixture(scope="module")
def tools() -> None:
    """Fails the test (not the whole run's collection) when a required tool is missing."""
    if MISSING is not None:
        pytest.fail(f"DTORCH_REQUIRE_BROWSER=1 but {MISSING}", pytrace=False)


def wait_for(condition, timeout: float, what: str, interval: float = 0.25):
    """Poll ``condition()`` until it returns something truthy; TimeoutError after
    ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------
# the JupyterLab server
# ---------------------------------------------------------------------------------------------
class Lab:
    """A running ``jupyter lab``: its base URL, token, root dir and log file."""

    def __init__(self, proc, url: str, token: str, root: Path, log: Path):
        self.proc, self.url, self.token, self.root, self.log = proc, url, token, root, log

    def api(self, path: str, method: str = "GET"):
        """JSON from the server's REST API (None for an empty reply)."""
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def answers(self) -> bool:
        try:
            return self.api("/api/status") is not None
        except OSError:
            return False

    def session(self, name: str) -> dict | None:
        """The server's session for notebook ``name`` (its kernel's id and state), or None."""
        return next((s for s in self.api("/api/sessions") if s["path"] == name), None)

    def shutdown_kernels(self) -> None:
        """Shut every kernel down (each ends its dtorch cluster) and wait until they are gone."""
        for k in self.api("/api/kernels"):
            self.api(f"/api/kernels/{k['id']}", method="DELETE")
        wait_for(lambda: self.api("/api/kernels") == [], 60, "the kernels to shut down")

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def lab_dirs(base: Path) -> dict[str, Path]:
    """Temp root (copies of the notebooks), kernelspec prefix, settings, workspaces, config."""
    dirs = {name: base / name for name in ("root", "prefix", "settings", "workspaces",
                                           "config", "runtime", "data")}
    for d in dirs.values():
        d.mkdir()
    for nb in NOTEBOOKS:
        shutil.copy(nb, dirs["root"] / nb.name)
    for rel, value in SETTINGS.items():
        f = dirs["settings"] / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(value))
    subprocess.run([sys.executable, "-m", "dtorch_kernel", "install", "--prefix",
                    str(dirs["prefix"])], check=True, capture_output=True, text=True, timeout=120)
    return dirs


def lab_env(dirs: dict[str, Path]) -> dict[str, str]:
    return {**os.environ, "JUPYTER_PATH": str(dirs["prefix"] / "share" / "jupyter"),
            "JUPYTER_CONFIG_DIR": str(dirs["config"]),
            "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
            "JUPYTER_DATA_DIR": str(dirs["data"]),
            "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
            "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]), "DTORCH_WORKERS": "4"}


def lab_command(dirs: dict[str, Path], port: int, token: str) -> list[str]:
    return [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
            f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={dirs['root']}",
            "--ServerApp.terminals_enabled=False",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"] + \
        (["--allow-root"] if os.geteuid() == 0 else [])  # CI runs as root


def stop(proc) -> None:
    """SIGTERM the server's process group (it shuts its kernels down), SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def lab(tools, tmp_path_factory):
    """``jupyter lab`` on 127.0.0.1 with a token, torn down (kernels first) at the end."""
    base = tmp_path_factory.mktemp("lab")
    dirs = lab_dirs(base)
    port, token = free_port(), os.urandom(16).hex()
    log = base / "jupyter-lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(lab_command(dirs, port, token), env=lab_env(dirs), cwd=dirs["root"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Lab(proc, f"http://127.0.0.1:{port}", token, dirs["root"], log)
    try:
        wait_for(lambda: proc.poll() is not None or server.answers(), 90, "JupyterLab to start")
        assert proc.poll() is None, f"jupyter lab exited:\n{server.log_tail()}"
        yield server
    finally:
        try:
            if proc.poll() is None:
                server.shutdown_kernels()
        finally:
            stop(proc)


@pytest.fixture(scope="module")
def browser(tools):
    """Headless Debian Chromium, driven by Playwright."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


# ---------------------------------------------------------------------------------------------
# reading the page
# ---------------------------------------------------------------------------------------------
CELLS_JS = """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-CodeCell')]
  .map(c => ({
    prompt: (c.querySelector('.jp-InputArea-prompt') || {}).textContent || '',
    outputs: [...c.querySelectorAll('.jp-OutputArea-output')].map(o => ({
      mime: o.getAttribute('data-mime-type') || '',
      text: o.textContent,
      widget: !!o.querySelector(':scope > .jupyter-widgets, :scope > * > .jupyter-widgets, ' +
                                ':scope > * > .dx-explorer'),  // anywidget views: their own root
    })),
  }))"""


def cells(page) -> list[dict]:
    """Every code cell on the page: its prompt and outputs (mime type, text, widget drawn)."""
    return page.evaluate(CELLS_JS)


def errors(cs: list[dict]) -> list[str]:
    """Error outputs: tracebacks or errors written to stderr."""
    return [o["text"][:2000] for c in cs for o in c["outputs"]
            if o["mime"] == STDERR_MIME and ("Traceback" in o["text"] or "Error" in o["text"])]


def finished(page, lab: Lab, name: str) -> bool:
    """Run All is over: every cell ran, or one failed (Run All stops there); kernel idle."""
    cs = cells(page)
    if not cs or any("*" in c["prompt"] for c in cs):
        return False
    ran = all(any(ch.isdigit() for ch in c["prompt"]) for c in cs)
    s = lab.session(name)
    return (ran or bool(errors(cs))) and s is not None and \
        s["kernel"]["execution_state"] == "idle"


def open_notebook(page, lab: Lab, name: str) -> None:
    """Open ``name`` in a fresh workspace and wait until its dtorch kernel is idle."""
    page.goto(f"{lab.url}/lab/tree/{name}?reset&token={lab.token}")
    page.locator(".jp-NotebookPanel .jp-CodeCell").first.wait_for(timeout=60_000)
    wait_for(lambda: (lab.session(name) or {}).get("kernel", {}).get("execution_state")
             == "idle", 90, f"the kernel of {name} to start")
    assert lab.session(name)["kernel"]["name"] == "dtorch"


def menu(page, top: str, item: str) -> None:
    """Click menu bar ``top``, then its item ``item`` (exact labels), as a user does."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{top}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{item}$")).click()


def saved(lab: Lab, name: str, code_cells: int) -> dict | None:
    """The notebook as saved on disk, once it holds ``code_cells`` executed code cells (None
    while it is not there yet, or the server is still writing it)."""
    try:
        nb = json.loads((lab.root / name).read_text())
    except json.JSONDecodeError:  # read in the middle of the save: poll again
        return None
    ran = [c for c in nb["cells"] if c["cell_type"] == "code" and c.get("execution_count")]
    return nb if len(ran) == code_cells else None


def save(page, lab: Lab, name: str, code_cells: int) -> dict:
    """*File → Save Notebook*; the saved notebook."""
    menu(page, "File", "Save Notebook")
    return wait_for(lambda: saved(lab, name, code_cells), 30, f"{name} to be saved")


def check_next_links(page, name: str) -> None:
    """Each link to another notebook opens it in a new tab (so the file exists)."""
    links = page.locator('.jp-RenderedMarkdown a[href$=".ipynb"]')
    targets = [links.nth(i).text_content() for i in range(links.count())]
    for i, target in enumerate(targets):
        links.nth(i).click()
        tab = page.locator(".lm-TabBar-tabLabel", has_text=re.compile(f"^{re.escape(target)}$"))
        tab.wait_for(timeout=30_000)
        assert page.locator(".jp-Dialog").count() == 0, f"{name}: opening {target} failed"


def check_page(cs: list[dict], body: str, name: str) -> None:
    """No error, every cell ran, the cluster's start line and a collective summary shown."""
    assert cs, "no code cells on the page"
    assert not errors(cs), f"{name}: error output:\n" + "\n---\n".join(errors(cs))
    assert all(any(ch.isdigit() for ch in c["prompt"]) for c in cs), \
        f"{name}: not every cell ran: {[c['prompt'] for c in cs]}"
    assert "Error displaying widget" not in body, name
    starts = 2 if name.startswith("07_") else 1  # 07 restarts the cluster once
    assert sum("ranks ready in" in o["text"] for c in cs for o in c["outputs"]) == starts, name
    assert any(SUMMARY_TITLE in o["text"] for c in cs for o in c["outputs"]), \
        f"{name}: no per-cell collective summary"


def check_widgets(cs: list[dict], saved: dict, name: str) -> None:
    """Every widget view the kernel sent (as saved in the notebook) is drawn as a widget."""
    sent = [o for c in saved["cells"] if c["cell_type"] == "code" for o in c["outputs"]
            if WIDGET_MIME in o.get("data", {})]
    drawn = [o for c in cs for o in c["outputs"] if o["widget"]]
    assert sent, f"{name}: the kernel sent no widget view"
    assert len(drawn) == len(sent), f"{name}: {len(sent)} widget views sent, {len(drawn)} drawn"


def summary_kinds(cs: list[dict], marker: str) -> list[str]:
    """The collective kinds the summary under the cell that printed ``marker`` names."""
    cell, = [c for c in cs if any(marker in o["text"] for o in c["outputs"])]
    texts = [o["text"] for o in cell["outputs"] if SUMMARY_TITLE in o["text"]]
    kinds = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")
    return [k for t in texts for k in kinds if k in t]


def check_collectives_notebook(cs: list[dict]) -> None:
    """02: a summary exactly under the cells that moved data, naming the right collective."""
    expect = {"Shard(0) -> Replicate :": ["all_gather"], "Replicate -> Shard(0) :": [],
              "Shard(0) -> Shard(1)  :": ["all_to_all"], "Partial -> Replicate :": ["all_reduce"],
              "Partial -> Shard(0)  :": ["reduce_scatter"]}
    for marker, kinds in expect.items():
        assert summary_kinds(cs, marker) == kinds, marker


def check_placement_explorer(page, shot: Path) -> None:
    """08: the first PlacementExplorer (Shard(0) -> Replicate) is drawn with its plan; picking
    S(1) as the target redraws the plan as an all_to_all (a kernel round trip, read from the
    page); its run button reports a measured time; play animates the transfers; a screenshot
    of it, blocks in flight, is saved to ``shot``."""
    explorer = page.locator(".dx-explorer:not(.dx-op)").first
    plan = explorer.locator(".dx-plan")
    assert "all_gather" in plan.text_content() and explorer.locator(".dx-tile").count() > 0
    explorer.locator('select.dx-pick[data-side="dst"]').first.select_option("S(1)")
    wait_for(lambda: "all_to_all" in plan.text_content(), 30, "the plan to redraw")
    assert "all_gather" not in plan.text_content()
    explorer.locator(".dx-run-button").click()
    measured = explorer.locator(".dx-measured")
    wait_for(lambda: "measured" in measured.text_content(), 60, "the run's measured time")
    assert "all_to_all ×1" in measured.text_content(), measured.text_content()
    assert "value equals torch's" in measured.text_content(), measured.text_content()
    explorer.locator(".dx-play").click()  # the transfers fly (JS errors would show up here)
    explorer.locator(".dx-flying").first.wait_for(timeout=5_000)
    page.wait_for_timeout(300)
    explorer.screenshot(path=str(shot))


def js_errors(page) -> list[str]:
    """Collects the page's uncaught exceptions and console errors from now on."""
    found: list[str] = []
    page.on("pageerror", lambda exc: found.append(f"uncaught: {exc}"))
    page.on("console", lambda msg: found.append(f"console: {msg.text}")
            if msg.type == "error" else None)
    return found


def check_mesh_view_is_live(page) -> None:
    """01: clicking a MeshView's "dp" button redraws its picture (a kernel round trip)."""
    view = page.locator(".jp-OutputArea-output",
                        has=page.locator(".widget-toggle-button", has_text="dp")).first
    picture = view.locator(".widget-html-content").first
    before = picture.inner_html()
    view.locator(".widget-toggle-button", has_text="dp").first.click()
    wait_for(lambda: picture.inner_html() != before, 30, "the MeshView to redraw")


# ---------------------------------------------------------------------------------------------
# the test
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_jupyterlab(path, lab, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    errors_in_js = js_errors(page)
    try:
        open_notebook(page, lab, path.name)
        menu(page, "Run", "Run All Cells")
        wait_for(lambda: finished(page, lab, path.name), 240, f"Run All of {path.name}", 0.5)
        cs = cells(page)
        check_page(cs, page.locator("body").text_content(), path.name)
        check_widgets(cs, save(page, lab, path.name, len(cs)), path.name)
        if path.name.startswith("01_"):
            check_mesh_view_is_live(page)
        if path.name.startswith("02_"):
            check_collectives_notebook(cs)
        if path.name.startswith("08_"):
            check_placement_explorer(page, tmp_path / "placement_explorer.png")
            if os.environ.get("DTORCH_UPDATE_SCREENSHOTS") == "1":  # docs/jupyter.md's picture
                shutil.copy(tmp_path / "placement_explorer.png", EXPLORER_SHOT)
            assert errors_in_js == [], errors_in_js
        check_next_links(page, path.name)
    except BaseException:
        report_failure(page, lab, tmp_path / f"{path.stem}.png")
        raise
    finally:
        page.close()
        if lab.proc.poll() is None:
            lab.shutdown_kernels()


def report_failure(page, lab: Lab, shot: Path) -> None:
    """Print where the failing page's screenshot is, and the server log's tail."""
    try:
        page.screenshot(path=str(shot))
        print(f"screenshot of the page: {shot}")
    except Exception as exc:  # noqa: BLE001 - the test's own error matters more
        print(f"no screenshot: {exc}")
    print(f"jupyter lab log (tail):\n{lab.log_tail()}")
