"""The per-cell summary and the collective table mark a backward's collectives apart from
the forward ones (pure: CommRecords, no cluster)."""

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
