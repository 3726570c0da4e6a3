"""A state file written whole: readers see the old content or the new, never half, and nothing is left beside it."""

import json

import pytest

from asyncrl.whole_files import write_json_whole


def test_the_new_content_replaces_the_old_and_no_partial_file_is_left(tmp_path):
    path = tmp_path / "state" / "server-0.chat.json"  # its folder is made
    write_json_whole(path, {"url": "http://127.0.0.1:1/v1"})
    write_json_whole(path, {"url": "http://127.0.0.1:2/v1"})
    assert json.loads(path.read_text()) == {"url": "http://127.0.0.1:2/v1"}
    assert [entry.name for entry in path.parent.iterdir()] == ["server-0.chat.json"]


def test_a_write_that_fails_leaves_the_old_file_as_it_was(tmp_path):
    path = tmp_path / "endpoints.json"
    write_json_whole(path, {"buffer": "tcp://127.0.0.1:5555"})
    with pytest.raises(TypeError):
        write_json_whole(path, {"buffer": object()})  # not JSON: refused before anything is written
    assert json.loads(path.read_text()) == {"buffer": "tcp://127.0.0.1:5555"}
