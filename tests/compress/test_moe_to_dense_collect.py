"""experiments.collect flags the MoE -> dense cells no faithful run can reproduce: at K = k the paper's text makes
every grouping the RR student, yet its Tables 3 / 12 give SF, PP, PS and CP other numbers under AB and OC."""

from __future__ import annotations

from experiments import collect

# by hand from the paper's Table 12 (spec 2.13): the K = 8 AB / OC cells of SF, PP, PS, CP, and Table 3's SF x AB
EXPECTED = {("Table 12", "SF x AB"), ("Table 12", "PP x AB"), ("Table 12", "PP x OC"), ("Table 12", "CP x AB"),
            ("Table 12", "CP x OC"), ("Table 3", "SF x AB")}


def test_exactly_the_k_equals_k_ab_oc_cells_are_flagged():
    reported = collect.load_reported("moe_to_dense")
    flagged = {(c["table"], c["paper_row"]) for c in reported if collect.moe_to_dense_construction_note(c)}
    assert flagged == EXPECTED
    # DO-ACP x OC K = 8 (5,134 = its RR cell) and SF x OC K = 64 stay comparable
    assert not any(collect.moe_to_dense_construction_note(c) for c in reported
                   if c["paper_row"] in ("DO-ACP x OC", "SF x OC", "DO-CP x AB"))


def test_flagged_rows_carry_the_reason_and_no_difference():
    reported = collect.load_reported("moe_to_dense")
    rows, _ = collect.compare(reported, [], all_tables=True, hub_average=True)
    rows = [{**r, "ours": 20000.0 if r["method"] == "SF x AB" else r["ours"]} for r in rows]
    rows = collect.flag_not_reproducible("moe_to_dense", rows, reported)
    sf_ab = [r for r in rows if r["table"] == "Table 12" and r["method"] == "SF x AB"]
    assert len(sf_ab) == 3 and all(r["diff"] is None for r in sf_ab)
    assert sf_ab[0]["note"] == (collect.NOT_REPRODUCIBLE + "K = k = 8: every group is one expert, so the paper's "
                                "text makes AB the RR student, yet its tables give this cell another value")
    assert all(not r["note"] for r in rows if r["method"] == "DO-ACP x OC")
    markdown = collect.to_markdown(rows, [])
    assert "| 20000.00\u00a7 |" in markdown and markdown.count("\u00a7 not reproducible by construction") == 2  # AB, OC
    assert collect.flag_not_reproducible("condense", rows[:2], reported) == rows[:2]  # other papers: no rule
