"""dtorch.checkpoint on the real cluster: save on one mesh, load on others (values equal to
the torch tensors saved), the format PyTorch's own SPMD programs read and write, save_async
beside a training step, a worker killed mid-save, and bad input refused before anything is
sent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard, init_device_mesh
from dtorch.runtime import session
from test_ops_support import illegal

HERE = os.path.dirname(__file__)
W = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5) / 7   # 7 rows: uneven on 2 and 4
B = torch.linspace(-1, 1, 6)
EMB = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))


def _saved_state(mesh):
    """A model, a plain tensor, Python values and a list, on ``mesh`` (dp x tp)."""
    return {"model": {"w": dtorch.distribute_tensor(W, mesh, [Shard(0), Shard(1)]),
                      "b": dtorch.distribute_tensor(B, mesh, [Replicate(), Shard(0)]),
                      "emb": dtorch.distribute_tensor(EMB, mesh, [Shard(0), Shard(0)])},
            "rng": torch.get_rng_state(), "step": 12, "lrs": [0.1, 0.01], "name": "run-1"}


def _target(mesh_of, placements_of):
    return {"model": {k: dtorch.zeros(*v.shape, device_mesh=mesh_of(k),
                                      placements=placements_of(k))
                      for k, v in {"w": W, "b": B, "emb": EMB}.items()},
            "rng": torch.zeros_like(torch.get_rng_state()), "step": None, "lrs": None,
            "name": None}


def _check_loaded(sd, rng):
    assert torch.equal(sd["model"]["w"].to_torch(), W)
    assert torch.equal(sd["model"]["b"].to_torch(), B)
    assert torch.equal(sd["model"]["emb"].to_torch(), EMB)
    assert torch.equal(sd["rng"], rng)
    assert (sd["step"], sd["lrs"], sd["name"]) == (12, [0.1, 0.01], "run-1")


@pytest.fixture
def saved(live, tmp_path):
    """A checkpoint written on dp2 x tp2, and the RNG state it holds."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd = _saved_state(mesh)
    path = tmp_path / "ckpt"
    dtorch.checkpoint.save(sd, path)
    return path, sd["rng"]


def test_each_rank_writes_its_own_shards(saved, tmp_path):
    path, _ = saved
    assert sorted(os.listdir(path)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    big = dtorch.randn(1024, 256, device_mesh=init_device_mesh("cpu", 4), placements=[Shard(0)])
    dtorch.checkpoint.save({"big": big}, tmp_path / "big")
    quarter = big.numel() * 4 // 4
    sizes = [os.path.getsize(tmp_path / "big" / f"__{r}_0.distcp") for r in range(4)]
    assert all(quarter <= s < quarter * 1.02 for s in sizes), sizes  # its block, no more


@pytest.mark.parametrize("layout", ["tp4", "pp2xtp2"])
def test_load_reshards_onto_other_meshes(saved, layout):
    path, rng = saved
    if layout == "tp4":
        mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
        target = _target(lambda k: mesh, lambda k: [Shard(1) if k == "w" else Shard(0)])
    else:  # two stages of 2 ranks: w and b on stage 0, emb on stage 1 (pipeline-staged)
        s0, s1 = (dtorch.DeviceMesh("cpu", ranks, mesh_dim_names=("tp",))
                  for ranks in ([0, 1], [2, 3]))
        target = _target(lambda k: s1 if k == "emb" else s0,
                         lambda k: [Replicate()] if k == "b" else [Shard(0)])
    dtorch.checkpoint.load(target, path)
    _check_loaded(target, rng)


def test_load_onto_a_two_rank_cluster_and_a_save_a_killed_worker_interrupts(
        saved, other_cluster, tmp_path):
    path, rng = saved
    other_cluster(n_workers=2)
    mesh = init_device_mesh("cpu", 2)
    target = _target(lambda k: mesh, lambda k: [Shard(0)])
    dtorch.checkpoint.load(target, path)
    _check_loaded(target, rng)

    before = {f: os.path.getmtime(path / f) for f in os.listdir(path)}
    doomed = {"model": {k: v * 2 for k, v in target["model"].items()},
              "step": _KillsTheRankThatWritesIt()}
    with pytest.raises(dtorch.WorkerLostError, match="SIGKILL"):
        dtorch.checkpoint.save(doomed, path)
    dtorch.restart()
    assert {f: os.path.getmtime(path / f) for f in os.listdir(path)} == before
    mesh = init_device_mesh("cpu", 2)
    again = _target(lambda k: mesh, lambda k: [Shard(0)])
    dtorch.checkpoint.load(again, path)
    _check_loaded(again, rng)  # the previous checkpoint, whole
    assert any(".dtorch-tmp-" in p for p in os.listdir(tmp_path))  # what the kill left
    dtorch.checkpoint.save(_target(lambda k: mesh, lambda k: [Shard(0)]), path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # a complete save clears it


class _KillsTheRankThatWritesIt:
    """A Python value that kills the rank process which pickles it into the checkpoint (the
    controller only checks that it pickles)."""

    def __reduce__(self):
        import multiprocessing
        if "Dask Worker" not in multiprocessing.current_process().name:  # the controller
            return (_KillsTheRankThatWritesIt, ())
        os.kill(os.getpid(), signal.SIGKILL)


def _spmd(action: str, path, spec_path) -> None:
    out = subprocess.run([sys.executable, os.path.join(HERE, "spmd_checkpoint.py"), action,
                          str(path), str(spec_path)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_torch_spmd_program_reads_what_dtorch_wrote_and_back(live, tmp_path):
    """PyTorch's own DTensor and torch.distributed.checkpoint in 4 plain processes, placed
    differently from dtorch: the same directory either way."""
    spec = {"tensors": {"w": (W, [("replicate",), ("shard", 1)]),
                        "emb": (EMB, [("shard", 0), ("shard", 0)])},
            "objects": {"step": 12}}
    spec_path = tmp_path / "spec.pt"
    torch.save(spec, spec_path)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours = {"model": {"w": dtorch.distribute_tensor(W, mesh, [Shard(0), Shard(1)]),
                      "emb": dtorch.distribute_tensor(EMB, mesh, [Shard(1), Replicate()])},
            "step": 12}
    dtorch.checkpoint.save(ours, tmp_path / "by_dtorch")
    _spmd("load", tmp_path / "by_dtorch", spec_path)

    _spmd("save", tmp_path / "by_torch", spec_path)
    tp = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    theirs = {"model": {"w": dtorch.zeros(7, 5, device_mesh=tp, placements=[Shard(0)]),
                        "emb": dtorch.zeros(9, 4, device_mesh=tp, placements=[Replicate()])},
              "step": None}
    dtorch.checkpoint.load(theirs, tmp_path / "by_torch")
    assert torch.equal(theirs["model"]["w"].to_torch(), W)
    assert torch.equal(theirs["model"]["emb"].to_torch(), EMB)
    assert theirs["step"] == 12

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(tmp_path / "by_dtorch", tmp_path / "one.pt")
    one = torch.load(tmp_path / "one.pt", weights_only=False)
    assert torch.equal(one["model"]["w"], W) and one["step"] == 12


def _model_and_optimizer(mesh):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model = dtorch.parallelize_module(net, mesh, {"0": dtorch.ColwiseParallel(),
                                                  "2": dtorch.RowwiseParallel()})
    return model, dtorch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _train_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def test_save_async_beside_a_training_step_and_resume_elsewhere(live, tmp_path):
    """The async save holds the parameters and optimizer state of when it was issued while the
    next step changes them; a new model and optimizer on another mesh resume from it and take
    the same next step as the original."""
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    model, opt = _model_and_optimizer(mesh)
    x = dtorch.distribute_tensor(torch.randn(5, 6, generator=torch.Generator().manual_seed(1)),
                                 mesh, [Replicate()])
    _train_step(model, opt, x)
    at_save = {k: v.to_torch() for k, v in model.state_dict().items()}
    fut = dtorch.checkpoint.save_async({"model": model.state_dict(), "optim": opt.state_dict()},
                                       tmp_path / "ckpt")
    _train_step(model, opt, x)  # issued while the ranks write
    after_two = {k: v.to_torch() for k, v in model.state_dict().items()}
    assert fut.result() is None
    assert not any(torch.equal(at_save[k], after_two[k]) for k in at_save)

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model2, opt2 = _model_and_optimizer(mesh2)
    opt2.init_state()
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dtorch.checkpoint.load(sd, tmp_path / "ckpt")
    opt2.load_state_dict(sd["optim"])
    for k, v in model2.state_dict().items():
        assert torch.equal(v.to_torch(), at_save[k]), k
    assert opt2.param_groups[0]["lr"] == 0.05 and opt2.state_dict()["state"][0]["step"].item() == 1
    _train_step(model2, opt2, dtorch.distribute_tensor(x.to_torch(), mesh2, [Replicate()] * 2))
    for k, v in model2.state_dict().items():
        torch.testing.assert_close(v.to_torch(), after_two[k], rtol=1e-6, atol=1e-6)


def test_a_partial_value_is_saved_reduced_and_loaded_where_it_is_held(live, tmp_path):
    mesh = init_device_mesh("cpu", 4)
    x = dtorch.distribute_tensor(torch.arange(8.), mesh, [Shard(0)])
    total = x.sum(0, keepdim=True)  # Partial: each rank its part
    with dtorch.CommDebugMode() as mode:
        dtorch.checkpoint.save({"total": total}, tmp_path / "ckpt")
    assert mode.get_comm_counts() == {"all_reduce": 1}  # reduced once, counted
    target = (x + 1).sum(0, keepdim=True)  # every rank holds a part of another value
    assert target.placements == (dtorch.Partial(),)
    with dtorch.CommDebugMode() as mode:
        dtorch.checkpoint.load({"total": target}, tmp_path / "ckpt")
    assert mode.get_comm_counts() == {}
    assert [target.to_local(r).item() for r in range(4)] == [28.0, 0.0, 0.0, 0.0]
    assert target.to_torch().item() == 28.0


def test_bad_input_is_refused_before_anything_is_sent(saved, tmp_path):
    path, _ = saved
    mesh = init_device_mesh("cpu", 4)
    w = dtorch.zeros(7, 5, device_mesh=mesh, placements=[Shard(0)])
    illegal(lambda: dtorch.checkpoint.load({"model": {"nope": w}}, path),
            "has no 'model.nope'", KeyError)
    wt = dtorch.zeros(5, 7, device_mesh=mesh, placements=[Shard(0)])
    illegal(lambda: dtorch.checkpoint.load({"model": {"w": wt}}, path), r"shape \(7, 5\)",
            ValueError)
    illegal(lambda: dtorch.checkpoint.load({"step": w}, path), "saved as a Python value",
            TypeError)
    illegal(lambda: dtorch.checkpoint.load({"w": w}, tmp_path), "not a checkpoint",
            FileNotFoundError)
    illegal(lambda: dtorch.checkpoint.load({"w": w}, tmp_path / "none"), "no checkpoint",
            FileNotFoundError)
    illegal(lambda: dtorch.checkpoint.save({"t": torch.ones(2), "f": lambda: 0}, tmp_path / "p"),
            "cannot be saved", TypeError)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("mine")
    illegal(lambda: dtorch.checkpoint.save({"w": w}, tmp_path / "data"),
            "not a checkpoint's .* keep.txt", FileExistsError)
    (tmp_path / "link").symlink_to(path)
    illegal(lambda: dtorch.checkpoint.save({"w": w}, tmp_path / "link"), "symbolic link",
            FileExistsError)
    illegal(lambda: dtorch.checkpoint.save([w], tmp_path / "q"), "is a dict", TypeError)
    assert torch.equal(w.to_torch(), torch.zeros(7, 5))
    assert not (tmp_path / "p").exists() and (tmp_path / "data" / "keep.txt").exists()


def test_a_failed_value_fails_the_save_on_every_rank_and_leaves_the_old_one(saved):
    """Rank 3's shard comes from a failed op: every rank answers, the save raises that
    failure, nobody hangs, the checkpoint at the path is unchanged, the cluster goes on."""
    import torch.nn.functional as F
    path, rng = saved
    mesh = init_device_mesh("cpu", 4)
    idx = dtorch.distribute_tensor(torch.tensor([0, 1, 2, 99]), mesh, [Shard(0)])
    bad = F.embedding(idx, dtorch.distribute_tensor(torch.randn(10, 3), mesh, [Replicate()]))
    before = sorted(os.listdir(path))
    with pytest.raises(dtorch.RemoteError, match="rank 3"):
        dtorch.checkpoint.save({"model": {"w": bad}}, path)
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
    assert sorted(os.listdir(path)) == before
    target = _target(lambda k: mesh, lambda k: [Shard(0)])
    dtorch.checkpoint.load(target, path)
    _check_loaded(target, rng)
    assert session.get_controller().world == 4
