"""Atomic writes and versioned JSON: readers never see half a file; every failure is one FileFormatError naming the
field."""
import json
import os

import pytest
from pydantic import BaseModel, ConfigDict

from runtime.errors import FileFormatError
from runtime.fileio import atomic_write_bytes, atomic_write_json, check_schema, read_versioned_json, validation_error


def test_atomic_write_creates_folders_leaves_no_temp_and_uses_the_umask(tmp_path):
    path = tmp_path / "a" / "b" / "x.json"
    atomic_write_json(path, {"schema": "npumoe.plan/1", "n": 1})
    assert json.loads(path.read_text()) == {"schema": "npumoe.plan/1", "n": 1}
    assert os.listdir(path.parent) == ["x.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.bin"
    path.write_bytes(b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["x.bin"]


@pytest.mark.parametrize("content,field,message", [
    (None, "file", "cannot read"),
    (b'{"schema": "npumoe.plan/1", ', "file", "not valid JSON"),
    (b"\xff\xfe", "file", "not valid JSON"),
    (b"[1, 2]", "file", "top level must be a JSON object"),
    (b'{"n": 1}', "schema", "expected 'npumoe.plan/1', got None"),
    (b'{"schema": "npumoe.profile/1"}', "schema", "expected 'npumoe.plan/1'"),
    (b'{"schema": "npumoe.plan/x"}', "schema", "bad version"),
    (b'{"schema": "npumoe.plan/0"}', "schema", "bad version"),
    (b'{"schema": "npumoe.plan/2"}', "schema", "newer than this npumoe reads (npumoe.plan/1); upgrade npumoe"),
])
def test_read_versioned_json_names_the_first_problem(tmp_path, content, field, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(FileFormatError) as e:
        read_versioned_json(path, "plan", 1)
    assert e.value.field == field and message in str(e.value) and str(path) in str(e.value)


def test_older_or_equal_versions_are_read(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"schema": "npumoe.plan/1", "x": [1]}')
    assert read_versioned_json(path, "plan", 2) == {"schema": "npumoe.plan/1", "x": [1]}
    check_schema({"schema": "npumoe.plan/2"}, "plan", 2)


class _Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int


class _Outer(BaseModel):
    layers: list[dict[str, list[_Inner]]]


@pytest.mark.parametrize("obj,field,shown", [
    ({"layers": [{"groups": [{"size": 1}, {"size": "big"}]}]}, "layers[0].groups[1].size", "(got 'big')"),
    ({"layers": [{"groups": [{"size": 1, "bad key\n": 2}]}]}, "layers[0].groups[0]['bad key\\n']", "(got 2)"),
    ({}, "layers", ""),
])
def test_validation_error_names_the_field_on_one_line(obj, field, shown):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        _Outer.model_validate(obj)
    err = validation_error("plan", "p.json", e.value)
    assert err.field == field and shown in str(err) and "\n" not in str(err)
    assert str(err).startswith(f"plan (p.json): {field}: ")
