"""`pat validate` on realistic mistakes: each file in invalid/ is a whole manifest whose first line says what the
error must contain (`# expect: <field path>: <message>`); the operator says the same (both use api.parse_job)."""

import re
from pathlib import Path

import pytest

from pat_workers.cli import main

INVALID = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))
EXAMPLE = Path(__file__).parents[2] / "examples" / "local.yaml"


def test_there_are_enough_cases():
    assert len(INVALID) >= 24


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_pat_validate_names_the_field_and_the_fix(path, capsys):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name}: the first line must be `# expect: <error>`"
    expected = first.removeprefix("# expect: ")
    assert re.match(r"(spec|metadata|apiVersion|kind)[\w.\[\]]*: ", expected), "the expectation names no field"
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err, err


def test_a_file_of_valid_jobs_prints_a_line_each(tmp_path, capsys):
    text = EXAMPLE.read_text()
    (tmp_path / "two.yaml").write_text(text + "---\n" + text.replace("name: arithmetic-grpo", "name: second") + "---\n")
    assert main(["validate", str(tmp_path / "two.yaml")]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == ["RLHFJob arithmetic-grpo: valid", "RLHFJob second: valid"] and out.err == ""


def test_every_document_is_checked_and_reported(capsys):
    assert main(["validate", str(Path(__file__).parent / "invalid" / "second-document-invalid.yaml")]) == 2
    out = capsys.readouterr()
    assert out.out == "RLHFJob first-ok: valid\n"
    assert "second-document-invalid.yaml (document 2) is invalid:\n  spec.algorithm.topP" in out.err


@pytest.mark.parametrize("text, error", [
    ("", "holds no document"),
    ("spec: [", "is not valid YAML"),
    ("- a\n- b\n", "kind: None is not RLHFJob"),
])
def test_files_that_hold_no_job(tmp_path, capsys, text, error):
    (tmp_path / "job.yaml").write_text(text)
    assert main(["validate", str(tmp_path / "job.yaml")]) == 2
    assert error in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
