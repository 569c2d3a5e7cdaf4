"""Result files are written atomically and read back exactly."""

import json
import os

import numpy as np
import pytest

from criticalkv.eval.io import prepare_out_dir, to_json, write_atomic, write_json
from criticalkv.eval.report import rounded


def test_json_round_trips_and_keeps_number_lists_on_one_line(tmp_path):
    data = {"grid": [[1.5, 2], [3, 4]], "text": "a [ b] c\nd", "items": ["x]", "[ y", 'q"'], "arr": np.arange(3)}
    write_json(tmp_path / "r.json", data)
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == {**data, "arr": [0, 1, 2]}
    assert '"arr": [0, 1, 2]' in text and "[1.5, 2]" in text
    assert json.loads(to_json({"s": "[\n]"})) == {"s": "[\n]"}


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, {"v": 1})

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(path, broken)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask


def test_out_dir_is_created_or_refused(tmp_path):
    assert prepare_out_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="cannot write results there"):
        prepare_out_dir(tmp_path / "f" / "sub")


def test_rounding_keeps_significant_digits():
    assert rounded({"a": [0.000123456, 123456.7, 0.0, float("nan")]}, 3)["a"][:3] == [0.000123, 123000.0, 0.0]
