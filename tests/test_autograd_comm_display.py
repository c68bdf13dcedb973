"""The per-cell summary and the collective table mark a backward's collectives apart from
the forward ones, and name the parameters whose gradients they reduced (pure CommRecords,
then a real backward on the 4-rank cluster)."""

import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard, init_device_mesh
from ledgers import counted
from dtorch.comm_debug import CommRecord, kind_label
from dtorch_kernel.summary import rows, summary_text
from dtorch_widgets.comm_picture import comm_rows, comm_table_html

G = ((0, 2), (1, 3))
FORWARD = CommRecord("all_gather", 0, "dp", G, 64)
BACKWARD = CommRecord("reduce_scatter", 0, "dp", G, 64, "sum", "backward")
BACKWARD_AR = CommRecord("all_gather", 0, "dp", G, 64, None, "backward")


def test_kind_label():
    assert kind_label(FORWARD) == "all_gather"
    assert kind_label(BACKWARD) == "reduce_scatter (backward)"


def test_summary_rows_keep_the_phases_apart():
    recs = [FORWARD, BACKWARD, BACKWARD_AR, FORWARD]
    assert rows(recs) == [("all_gather", "dim dp", 2, 128),
                          ("reduce_scatter (backward)", "dim dp", 1, 64),
                          ("all_gather (backward)", "dim dp", 1, 64)]
    assert "all_gather (backward) x1" in summary_text(recs)
    assert [r[0] for r in comm_rows(recs)] == ["all_gather", "reduce_scatter (backward)",
                                               "all_gather (backward)"]
    assert "reduce_scatter (backward)" in comm_table_html(recs)


def test_a_row_names_the_gradients_it_reduced():
    named = [BACKWARD._replace(gradient_of="fc.weight"), BACKWARD._replace(gradient_of="fc.bias")]
    assert summary_text(named) == ("dtorch: 2 collectives: reduce_scatter (backward) x2 "
                                   "(dim dp, 128 B/rank; for fc.weight, fc.bias)")
    html = comm_table_html([FORWARD] + named)
    assert "for the gradients of" in html and "fc.weight, fc.bias" in html
    assert "for the gradients of" not in comm_table_html([FORWARD, BACKWARD])


class _Net(dtorch.nn.Module):
    """A DP linear (Replicate weights) beside an FSDP-style weight (Shard(0), gathered at
    use): backward all_reduces the first, reduce_scatters the second."""

    def __init__(self, mesh, fc: torch.nn.Linear, w: torch.Tensor):
        super().__init__()
        self.fc = dtorch.nn.ReplicateParallelLinear(4, 4, device_mesh=mesh)
        self.fc.load_state_dict(fc.state_dict())
        self.sharded = dtorch.tensor(w, device_mesh=mesh, placements=[Shard(0)])

    def forward(self, x):
        return F.linear(self.fc(x), self.sharded.redistribute(placements=[Replicate()]))


def test_backward_collectives_name_the_parameters_they_served(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    fc, w = torch.nn.Linear(4, 4), torch.randn(8, 4, requires_grad=True)
    net = _Net(mesh, fc, w.detach())
    x = torch.randn(8, 4)
    loss = (net(dtorch.tensor(x, device_mesh=mesh, placements=[Shard(0)])) ** 2).mean()
    dtorch.synchronize()
    with dtorch.CommDebugMode() as mode:
        _, counts = counted(loss.backward)
    assert counts == {"all_reduce": 2, "reduce_scatter": 1}  # the workers' own counts
    assert mode.get_gradient_comm_counts() == {
        "fc.weight": {"all_reduce": 1}, "fc.bias": {"all_reduce": 1},
        "sharded": {"reduce_scatter": 1}}
    assert "for fc.weight, fc.bias" in summary_text(mode.get_comm_records())
    (F.linear(fc(x), w) ** 2).mean().backward()
    torch.testing.assert_close(net.fc.weight.grad.to_torch(), fc.weight.grad)
    torch.testing.assert_close(net.sharded.grad.to_torch(), w.grad)
    assert net.sharded.grad.placements == (Shard(0),)
