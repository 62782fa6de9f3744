"""Atomic writes: errors name the file asked for, a killed writer's temporary files do not
block or litter a directory (issue 80, items 17 and 18)."""

import os
import time

import pytest

from netpart.cli import main
from netpart.files import foreign_entries, is_temporary, write_atomic


def test_writing_over_a_directory_names_the_path_given(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(IsADirectoryError) as err:
        write_atomic(target, b"x")
    assert err.value.filename == str(target)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary file left


def test_a_killed_writer_s_temporary_file_is_neither_foreign_nor_left(tmp_path):
    left = tmp_path / ".plan.json.abcd1234.tmp"  # as a SIGKILL during a write leaves it
    left.write_bytes(b"half")
    old = time.time() - 60
    os.utime(left, (old, old))
    assert is_temporary(left.name) and not is_temporary("plan.json")
    assert foreign_entries(tmp_path, "plan.json") == []  # the directory is reusable
    write_atomic(tmp_path / "plan.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # swept
    other = tmp_path / ".report.md.abcd1234.tmp"  # another file's: not this write's to sweep
    other.write_bytes(b"")
    write_atomic(tmp_path / "plan.json", b"{}")
    assert other.exists()


def test_plan_out_reuses_a_directory_holding_only_its_own_temporary_file(tmp_path, capsys):
    out = tmp_path / "pp"
    out.mkdir()
    (out / ".plan.json.k3j2h1g0.tmp").write_bytes(b"{")
    assert main(["plan", "--model", "tiny-mlp", "--workers", "2", "--out", str(out)]) == 0
    assert (out / "plan.json").exists()
