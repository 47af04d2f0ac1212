import os

import pytest

import pipecore as pc

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
GOLDEN_CONFIGS = [("gpipe", 2, 4, None), ("1f1b", 4, 8, None), ("interleaved_1f1b", 2, 4, 2),
                  ("interleaved_zb", 4, 8, 1), ("zbv", 2, 4, 2), ("dualpipev", 2, 4, 2), ("dualpipe", 2, 4, 2),
                  ("looped_bfs", 2, 4, 2)]


@pytest.mark.parametrize("name, R, m, V", GOLDEN_CONFIGS)
def test_golden_csvs(name, R, m, V):
    path = os.path.join(GOLDEN, f"{name}_r{R}_m{m}.csv")
    s = pc.build_schedule(name, R, m, V)
    golden = pc.Schedule.from_csv(path, placement=s.placement)
    assert golden.actions == s.actions


@pytest.mark.parametrize("name", pc.SCHEDULES)
def test_round_trip(tmp_path, name):
    s = pc.build_schedule(name, 4, 8)
    for sched in (s, s.lower()):
        path = tmp_path / "s.csv"
        sched.to_csv(path)
        # no placement given: dualpipe's is told from its stages' microbatches (the configuration space
        # found dualpipe's CSV read back as a V schedule: "missing 0F4")
        back = pc.Schedule.from_csv(path)
        assert back.placement == s.placement and back.topology == s.topology
        assert back.actions == sched.actions
        assert back.num_stages == s.num_stages and back.num_microbatches == s.num_microbatches
        assert [back.stage_to_rank(x) for x in range(s.num_stages)] == [s.stage_to_rank(x) for x in range(s.num_stages)]
        back.validate()


def test_torch_reads_our_csv(tmp_path):
    import csv

    from torch.distributed.pipelining.schedules import _Action

    s = pc.build_schedule("dualpipev", 2, 4).lower()
    path = tmp_path / "s.csv"
    s.to_csv(path)
    with open(path, newline="") as f:
        rows = [[str(_Action.from_str(cell)) for cell in row] for row in csv.reader(f)]
    assert rows == [[str(a) for a in row] for row in s.actions]


def test_we_read_torch_csv_with_empty_cells(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("0F0,,0B0\n,1F0,1B0\n")
    s = pc.Schedule.from_csv(path)
    assert [[str(a) for a in row] for row in s.actions] == [["0F0", "0B0"], ["1F0", "1B0"]]
    s.validate()


def test_bad_cell_names_row_and_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1X0\n")
    with pytest.raises(pc.ScheduleError, match=r"row 2 \(rank 1\), column 2: cannot parse action '1X0'"):
        pc.Schedule.from_csv(path)
    with pytest.raises(FileNotFoundError):
        pc.Schedule.from_csv(tmp_path / "missing.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(pc.ScheduleError, match="empty schedule CSV"):
        pc.Schedule.from_csv(tmp_path / "empty.csv")


def test_format_table():
    s = pc.build_schedule("1f1b", 2, 2)
    text = s.format()
    lines = text.splitlines()
    assert lines[0].split() == ["Rank", "0", "Rank", "1"]
    assert lines[1].split() == ["Step", "0:", "0F0"]
    assert lines[2].split() == ["Step", "1:", "0F1", "1F0"]
    assert all(str(a) in text for row in s.actions for a in row)
    plain = s.format(aligned=False)
    assert plain.splitlines()[1].split() == ["Step", "0:", "0F0", "1F0"]
    assert str(s) == text
    assert "actions=8" in repr(s)
