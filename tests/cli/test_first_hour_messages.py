"""What a new user gets for the two commonest first-hour mistakes: a CSV (or another table)
given as a prompt file is pointed to ``kvcouple prompts``; a folder or file that is not a
trace store says so, and what to give instead (not zarr's wording)."""

from __future__ import annotations

import pytest

from kvcouple.cli import main
from kvcouple.tracer.prompts import PromptFileError, load_prompts


def test_a_csv_prompt_file_points_to_kvcouple_prompts(tmp_path):
    csv = tmp_path / "docs.csv"
    csv.write_text("id,text\na,hello there\n")
    with pytest.raises(PromptFileError) as e:
        load_prompts(csv)
    assert "line 1: not valid JSON" in str(e.value)
    assert "to trace a CSV file, build the prompt file from it first: kvcouple prompts" in str(
        e.value
    )
    assert f"kvcouple prompts {csv} --field TEXT_COLUMN --out prompts.jsonl" in str(e.value)


@pytest.mark.parametrize("command", ["info", "show", "analyze"])
def test_a_folder_that_is_not_a_store_says_what_to_give(tmp_path, capsys, command):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("hi")
    extra = {"info": [], "show": ["--doc", "a"], "analyze": ["--out", str(tmp_path / "r")]}
    assert main([command, str(folder), *extra[command]]) == 2
    err = capsys.readouterr().err
    assert "is a folder but not a trace store (no Zarr metadata in it)" in err
    assert "kvcouple trace --out wrote" in err and "No group found" not in err
    (folder / "run.zarr").mkdir()
    (folder / "run.zarr" / "zarr.json").write_text("{}")
    assert main([command, str(folder), *extra[command]]) == 2
    assert f"it holds {folder / 'run.zarr'}: give that" in capsys.readouterr().err
    assert main([command, str(folder / "notes.txt"), *extra[command]]) == 2
    assert "is a file, not a trace store" in capsys.readouterr().err
