"""The matching-pass benchmark runs on a CPU, reports every case and refuses bad arguments by name."""
import json

import pytest

from deform_plugin.benchmarks.detector import matching_pass


def test_it_times_every_case_and_writes_its_table(tmp_path, capsys):
    assert matching_pass.main(["--device", "cpu", "--warmup", "0", "--repeats", "2", "--scale", "0.05",
                               "--gts", "3", "0", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "matching_pass.json").read_text())
    assert [row["case"] for row in report["rows"]] == list(matching_pass.CASES)
    for row in report["rows"]:
        assert row["gts"] == [3, 0] and row["launch_ms"]["n"] == row["pass_ms"]["n"] == 2
        # The launch is part of the pass.
        assert 0 < row["launch_ms"]["median_ms"] <= row["pass_ms"]["median_ms"]
    assert (tmp_path / "matching_pass.md").read_text().strip() == printed.strip()
    # At 1/20 of the queries: DINO 6 layers x 45 queries and 45 proposals, Deformable-DETR 6 x 15.
    assert "| dino | 315 | 3, 0 |" in printed and "| deformable-detr | 90 | 3, 0 |" in printed


@pytest.mark.parametrize("argv,bad", [(["--repeats", "0"], "0"), (["--scale", "2"], "2.0"), (["--gts", "-1"], "-1")])
def test_bad_arguments_are_refused_by_value(argv, bad, capsys):
    with pytest.raises(SystemExit):
        matching_pass.main(["--device", "cpu"] + argv)
    assert bad in capsys.readouterr().err
