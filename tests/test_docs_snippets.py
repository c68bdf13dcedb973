"""README.md and docs/*.md as a newcomer reads them: every ```python block runs as written, in
a fresh namespace, on the session's 4-rank cluster (``init_device_mesh`` uses it, and
``dtorch.init(...)`` with arguments it satisfies returns it; a snippet that starts another
cluster or shuts it down gets the 4-rank one back after it); what a snippet's comments claim is checked
for the snippets in ``CHECKS``. Every other block is tagged ``bash`` or ``text``. A python block
that cannot run here starts with ``# not run: <reason>`` (counted, kept rare). Every link points
inside the repository, at a file (and a heading) that exists; the statements the docs make
about the API (``DryRunError``, ``to_local()``, ``rank_stats()``) hold.
"""

import gc
import re
from pathlib import Path

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.runtime import session

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
LANGS = ("python", "bash", "text")
NOT_RUN = "# not run:"
MAX_NOT_RUN = 3


def blocks(path: Path) -> list[tuple[str, int, str]]:
    """``(language, line of the opening fence, code)`` of every fenced block (indented too)."""
    out, lang, start, lines, indent = [], None, 0, [], ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if lang is None:
            if fence:
                lang, start, lines, indent = fence.group(2), number, [], fence.group(1)
        elif fence and not fence.group(2):
            out.append((lang, start, "\n".join(lines) + "\n"))
            lang = None
        else:
            lines.append(line[len(indent):] if line.startswith(indent) else line)
    assert lang is None, f"{path.name}:{start}: a code fence is never closed"
    return out


def python_blocks() -> list[tuple[str, str]]:
    return [(f"{p.relative_to(ROOT)}:{line}", code)
            for p in DOCS for lang, line, code in blocks(p) if lang == "python"]


SNIPPETS = python_blocks()


# What the comments of a snippet say, checked on its namespace after it ran. Keyed by a string
# only that snippet contains (test_checks_find_their_snippet keeps the keys current).
def _quick_example(s):
    assert s["m"].get_comm_counts() == {"all_gather": 2}
    assert torch.equal(s["d"].to_local(3), torch.tensor([[10., 11.], [14., 15.]]))
    assert s["d"].local_shapes() == {r: (2, 2) for r in range(4)}
    assert torch.equal(s["r"].to_torch(), torch.arange(16.).reshape(4, 4))


def _operators(s):
    assert s["out"].placements == (Partial(),)
    torch.testing.assert_close(s["out"].to_torch(), s["x"] @ s["w"])
    assert "fix: input.redistribute(placements=[Shard(0)])   # all_to_all" in s["message"]


def _context_parallel(s):
    assert s["m"].get_comm_counts() == {"all_to_all": 4, "send_recv": 1}
    assert s["out"].placements == s["q"].placements


def _tp_mlp(s):
    assert s["m"].get_comm_counts() == {"all_reduce": 1}
    torch.testing.assert_close(s["y"].to_torch(), s["torch_mlp"](s["batch"]))
    full = s["full"]
    assert set(full) == set(s["torch_mlp"].state_dict())
    for key, value in s["torch_mlp"].state_dict().items():
        assert torch.equal(full[key], value), key


def _autograd(s):
    assert s["m"].get_comm_counts() == {"all_reduce": 1}
    assert s["w"].grad.placements == (Replicate(),)
    w = s["w"].to_torch().requires_grad_()
    ((s["x"].to_torch() @ w - s["t"].to_torch()) ** 2).mean().backward()
    torch.testing.assert_close(s["w"].grad.to_torch(), w.grad)


def _dropout(s):
    assert torch.equal(s["y"].to_torch(), s["ref"])
    assert s["stream"].state().counter == 1


def _transformers(s):
    assert s["mode"].get_comm_counts() == {"all_reduce": 4}
    assert s["tokens"].placements == (Shard(0), Replicate())


def _fully_shard(s):
    assert s["forward"] == {"all_gather": 4}
    assert s["mode"].get_comm_counts() == {"all_gather": 8, "reduce_scatter": 4}
    assert s["model"].layers[0].weight.grad.placements == (Shard(0),)


def _optim(s):
    assert s["mode"].get_comm_counts() == {}
    assert s["opt"].state[s["model"][0].weight]["exp_avg"].placements == (Replicate(), Shard(0))


def _checkpoint(s):
    assert s["state"]["step"] == 1
    for a, b in zip(s["model"].parameters(), s["model2"].parameters()):
        assert torch.equal(a.to_torch(), b.to_torch())
    assert s["opt2"].state_dict()["state"][0]["step"].item() == 1
    assert s["model2"][0].weight.device_mesh.ndim == 2


def _ddp(s):
    assert s["mode"].get_comm_counts() == {"all_reduce": 1}


def _cost_model(s):
    t = s["t"]
    assert t.counts == {"all_gather": 1} and t.comm_s > 0
    assert [c.kind for c in t.predicted.steps] == ["all_gather"] and t.predicted.total_s > 0
    rows = dtorch.cluster_info()["links"]  # the prediction fitted what it needed
    assert ("all_gather", 4, 1) in {(r["kind"], r["group_size"], r["groups"]) for r in rows}


CHECKS = {
    "d.local_shapes()": _quick_example,
    "out = xs @ ws": _operators,
    "ring_cp": _context_parallel,
    "nn.full_state_dict(mlp)": _tp_mlp,
    "loss.backward()\nm.get_comm_counts()": _autograd,
    "stream.dropout(": _dropout,
    "transformers' own generate": _transformers,
    "dtorch.fully_shard(layer, mesh": _fully_shard,
    "opt = dtorch.optim.AdamW(": _optim,
    "dtorch.checkpoint.save_async(": _checkpoint,
    "model = dtorch.DistributedDataParallel(net": _ddp,
    "t = dtorch.time_comms(": _cost_model,
}


def test_every_block_is_tagged():
    """A block without a language could hide Python the test never runs."""
    bad = [f"{p.relative_to(ROOT)}:{line} ```{lang}" for p in DOCS
           for lang, line, _ in blocks(p) if lang not in LANGS]
    assert not bad, f"tag these blocks with one of {LANGS}: {bad}"


def test_not_run_blocks_are_few_and_say_why():
    skipped = [(where, code) for where, code in SNIPPETS if code.startswith(NOT_RUN)]
    assert len(skipped) <= MAX_NOT_RUN, [where for where, _ in skipped]
    for where, code in skipped:
        assert len(code.splitlines()[0]) > len(NOT_RUN) + 10, f"{where}: say why it does not run"


def test_checks_find_their_snippet():
    for key in CHECKS:
        found = [where for where, code in SNIPPETS if key in code]
        assert len(found) == 1, f"CHECKS key {key!r} matches {found}"


@pytest.mark.parametrize("where,code", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_runs(where, code, live):
    if code.startswith(NOT_RUN):
        pytest.skip(code.splitlines()[0])
    scope: dict = {"__name__": "__snippet__"}
    try:
        exec(compile(code, where, "exec"), scope)
        dtorch.synchronize()  # an error on a rank is this snippet's failure
        for key, check in CHECKS.items():
            if key in code:
                check(scope)
    finally:
        scope.clear()
        gc.collect()  # its DTensors must not outlive it (a later test may restart the cluster)
        if session._controller is not live:  # it started another cluster or shut this one
            dtorch.shutdown()
            dtorch.init(n_workers=4)


# links ------------------------------------------------------------------------------------
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines()
            if re.match(r"^#{1,6} ", line)}


def test_links_stay_inside_the_repository():
    bad = []
    for page in DOCS:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue  # a web address (none today), not a path
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if ROOT not in dest.parents and dest != ROOT or not dest.exists():
                bad.append(f"{page.name}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no heading #{anchor})")
    assert not bad, bad


# statements the docs make about the API ----------------------------------------------------
def test_dry_run_error_is_exported():
    from dtorch.runtime.dry_run import DryRunError
    assert dtorch.DryRunError is DryRunError and issubclass(DryRunError, dtorch.DTorchError)


def test_to_local_without_a_rank_lists_the_ranks(live):
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = dtorch.distribute_tensor(torch.arange(6.), mesh, [Shard(0), Replicate()])
    with pytest.raises(TypeError, match=r"pick one of \[0, 1, 2, 3\].*to_torch"):
        x.to_local()
    sub = dtorch.DeviceMesh("cpu", [1, 3])
    y = dtorch.distribute_tensor(torch.arange(3.), sub, [Shard(0)])
    with pytest.raises(TypeError, match=r"pick one of \[1, 3\]"):
        y.to_local()
    assert torch.equal(y.to_local(3), torch.tensor([2.]))  # torch.chunk(3, 2): sizes 2, 1


def test_rank_stats_is_a_list_of_per_rank_dicts(live):
    mesh = dtorch.init_device_mesh("cpu", 4)
    x = dtorch.distribute_tensor(torch.arange(10.), mesh, [Shard(0)])
    before = [s["dist_calls"] for s in dtorch.rank_stats()]
    x.redistribute(placements=[Replicate()]).to_torch()
    stats = dtorch.rank_stats()
    assert isinstance(stats, list) and [s["rank"] for s in stats] == [0, 1, 2, 3]
    assert [s["dist_calls"] - b for s, b in zip(stats, before)] == [1, 1, 1, 1]


def test_a_plain_install_ships_every_package():
    """``pip install .`` (not editable) installs only the packages pyproject.toml lists."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "dtorch").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_notebook_count_is_current():
    """"six notebooks": the number the docs say is the number in notebooks/."""
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
             "ten", "eleven", "twelve"]
    real = len(list((ROOT / "notebooks").glob("*.ipynb")))
    for page in DOCS:
        for said in re.findall(r"\b(\w+) notebooks\b", page.read_text()):
            if said.lower() in words:
                assert words.index(said.lower()) == real, \
                    f"{page.name} says {said} notebooks; notebooks/ has {real}"
