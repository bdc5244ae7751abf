"""Downloads (``hetfl.data.datasets.download``): what mutation testing of the module (``benchmarks/mutation.py``
target ``datasets_download``, session 42) showed the loaders' tests leave unchecked.

A mirror whose file fails its checksum or arrives cut short is discarded and the *next* mirror tried; the file
being downloaded is a hidden ``.NAME.XXXXXXXX.part`` (a killed download leaves nothing a loader or the cache's
fingerprint reads) in a folder made with its parents; a download never waits without end (urllib's timeout);
and the messages, word for word: a refused connection names its reason, not urllib's wrapper, the failures of
all mirrors are listed in order, and the missing files' message names what to put where. Stand-ins for urllib's
responses where a real server cannot be made to misbehave on cue.
"""

from __future__ import annotations

import email.message
import hashlib
import os
import re
import urllib.error
from types import SimpleNamespace

import pytest

from hetfl.data.base import DatasetError
from hetfl.data.datasets import download

BODY = b"the official file's bytes"
MD5 = hashlib.md5(BODY).hexdigest()


class Response:
    """What ``fetch`` reads of ``urllib.request.urlopen``'s answer: its headers, status and body (read in
    blocks); ``during_read`` is called at the first read (to look at the folder mid-download)."""

    def __init__(self, body: bytes, *, announced: int | None = None, status: int | None = 200,
                 during_read=None) -> None:
        self.body, self.status, self.during_read = body, status, during_read
        self.headers = email.message.Message()  # http.client's headers: names match whatever their case
        if announced is not None:
            self.headers["Content-Length"] = str(announced)

    def read(self, size: int | None = None) -> bytes:
        if self.during_read is not None:
            self.during_read()
            self.during_read = None
        size = len(self.body) if size is None or size < 0 else size  # None: the rest, as http.client reads
        block, self.body = self.body[:size], self.body[size:]
        return block

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def served(monkeypatch):
    """``urllib.request.urlopen`` answering each URL from a table (a Response, or an exception to raise);
    returns the table and the list of (url, keyword arguments) it was called with."""
    answers: dict[str, object] = {}
    calls: list[tuple[str, dict]] = []

    def urlopen(url, **kwargs):
        calls.append((url, kwargs))
        answer = answers[url]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(download.urllib.request, "urlopen", urlopen)
    return answers, calls


# ------------------------------------------------------------------ mirrors: the next one after a bad file
def test_a_mirror_whose_file_fails_its_checksum_is_discarded_and_the_next_mirror_gives_the_file(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "f.bin").write_bytes(b"another file")
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "f.bin").write_bytes(BODY)
    remote = download.Remote("f.bin", ((tmp_path / "bad" / "f.bin").as_uri(), (tmp_path / "good" / "f.bin").as_uri()),
                             md5=MD5)
    assert download.fetch(remote, tmp_path / "root").read_bytes() == BODY
    assert os.listdir(tmp_path / "root") == ["f.bin"]


def test_a_mirror_that_cuts_the_download_short_is_discarded_and_the_next_mirror_gives_the_file(tmp_path, served):
    answers, _ = served
    answers["http://a/f.bin"] = Response(BODY[:4], announced=len(BODY))
    answers["http://b/f.bin"] = Response(BODY, announced=len(BODY))
    remote = download.Remote("f.bin", ("http://a/f.bin", "http://b/f.bin"), md5=MD5)
    assert download.fetch(remote, tmp_path).read_bytes() == BODY and os.listdir(tmp_path) == ["f.bin"]


def test_every_mirrors_failure_is_named_in_order_word_for_word(tmp_path, served):
    answers, _ = served
    answers["http://a/f.bin"] = Response(BODY[:4], announced=len(BODY))
    answers["http://b/f.bin"] = Response(b"x" * 7, announced=7)
    answers["http://c/f.bin"] = urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))
    answers["d://f.bin"] = ValueError("unknown url type: 'd'")
    remote = download.Remote("f.bin", tuple(answers), md5=MD5)
    with pytest.raises(DatasetError) as err:
        download.fetch(remote, tmp_path)
    assert str(err.value) == (
        f"could not download f.bin (http://a/f.bin: incomplete download (4 of {len(BODY)} bytes; the connection was "
        f"cut?), discarded; http://b/f.bin: checksum mismatch (md5 {hashlib.md5(b'x' * 7).hexdigest()}, expected "
        f"{MD5}), discarded; http://c/f.bin: [Errno 111] Connection refused; d://f.bin: unknown url type: 'd')")
    assert os.listdir(tmp_path) == []  # nothing half-written left behind


def test_a_download_waits_at_most_the_timeout_for_the_server(tmp_path, served):
    answers, calls = served
    answers["http://a/f.bin"] = Response(BODY)
    download.fetch(download.Remote("f.bin", ("http://a/f.bin",), md5=MD5), tmp_path)
    assert calls == [("http://a/f.bin", {"timeout": download.TIMEOUT_S})] and download.TIMEOUT_S == 60.0


# ------------------------------------------------------------------ the file being downloaded
def test_the_file_being_downloaded_is_hidden_next_to_its_destination_in_a_folder_made_with_its_parents(
        tmp_path, served):
    """A download killed mid-way leaves ``.f.bin.XXXXXXXX.part``: hidden, so neither a loader nor the cache's
    fingerprint of the data folder (which skips hidden entries) reads it, and never under the final name."""
    folder = tmp_path / "a" / "b" / "root"
    seen: list[list[str]] = []
    answers, _ = served
    answers["http://a/f.bin"] = Response(BODY, during_read=lambda: seen.append(os.listdir(folder)))
    download.fetch(download.Remote("f.bin", ("http://a/f.bin",), md5=MD5), folder)
    (during,) = seen
    assert len(during) == 1 and re.fullmatch(r"\.f\.bin\.[a-z0-9_]{8}\.part", during[0]), during
    assert os.listdir(folder) == ["f.bin"]


def test_a_folder_that_cannot_be_made_is_named_with_the_systems_reason(tmp_path):
    (tmp_path / "root").write_text("a file where the folder should be")
    with pytest.raises(DatasetError) as err:
        download.fetch(download.Remote("f.bin", ("http://a/f.bin",), md5=MD5), tmp_path / "root")
    assert str(err.value) == f"cannot write into {tmp_path / 'root'} to download f.bin (File exists)"


# ------------------------------------------------------------------ the announced size
@pytest.mark.parametrize(("response", "size"), [
    (Response(b"", announced=12), 12),
    (Response(b"", announced=12, status=None), None),  # a file:// URL: urllib announces a size, no status
    (Response(b"", announced=12, status=206), None),
    (Response(b""), None),
    (SimpleNamespace(status=200), None),  # no headers at all
    (SimpleNamespace(headers=None, status=200), None),
    (SimpleNamespace(headers={"Content-Length": "12"}), None),  # no status
])
def test_the_announced_size_is_an_http_200s_content_length(response, size):
    assert download._announced_size(response) == size


def test_an_announced_size_that_is_not_a_number_is_ignored():
    response = Response(b"")
    response.headers["Content-Length"] = "twelve"
    assert download._announced_size(response) is None


# ------------------------------------------------------------------ the messages when files are missing
def test_a_missing_file_with_downloading_off_names_what_to_put_where(tmp_path):
    remotes = [download.Remote("a.bin", ("http://a/a.bin",), md5=MD5),
               download.Remote("b.bin", ("http://a/b.bin",), md5=MD5)]
    (tmp_path / "b.bin").write_bytes(b"")
    with pytest.raises(DatasetError) as err:
        download.ensure(tmp_path, remotes, download=False, dataset="demo")
    assert str(err.value) == (f"demo: a.bin not found in {tmp_path} and downloading is off (data.download = false). "
                              f"Put the official file(s) into {tmp_path}, or set data.root to the folder that holds "
                              "them")
    with pytest.raises(DatasetError) as err:
        download.ensure(tmp_path, remotes, download=False, dataset="demo", alternative="or the folder a/",
                        incomplete="a/ lacks x")
    assert str(err.value).endswith(f"Put the official file(s) or the folder a/ into {tmp_path}, or set data.root to "
                                   "the folder that holds them. a/ lacks x")
    assert download.ensure(tmp_path, remotes[1:], download=False, dataset="demo") == [tmp_path / "b.bin"]


def test_a_data_root_that_is_a_file_is_refused_before_any_download(tmp_path, served):
    _, calls = served
    (tmp_path / "root").write_text("")
    with pytest.raises(DatasetError) as err:
        download.ensure(tmp_path / "root", [download.Remote("a.bin", ("http://a/a.bin",), md5=MD5)], download=True,
                        dataset="demo")
    assert str(err.value) == (f"demo: data.root = {str(tmp_path / 'root')!r} is a file, not a folder to download "
                              "into; set data.root to a folder")
    assert calls == []


def test_a_partly_filled_folder_is_named_with_what_it_lacks(tmp_path):
    names = ["a", "b", "c"]
    (tmp_path / "some").mkdir()
    (tmp_path / "some" / "b").write_bytes(b"")
    (tmp_path / "all").mkdir()
    for name in names:
        (tmp_path / "all" / name).write_bytes(b"")
    (tmp_path / "none").mkdir()
    assert download.incomplete_folder([tmp_path / "all", tmp_path / "none", tmp_path / "nowhere"], names) == ""
    assert download.incomplete_folder([tmp_path / "all", tmp_path / "some"], names) == \
        f"{tmp_path / 'some'} lacks a, c (it holds 1 of the 3 files)"


def test_a_remote_without_a_checksum_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^f\.bin: a Remote needs an md5 or sha256 checksum$"):
        download.Remote("f.bin", ("http://a/f.bin",))


def test_a_sha256_mismatch_names_its_algorithm(tmp_path, served):
    answers, _ = served
    answers["http://a/f.bin"] = Response(b"other")
    remote = download.Remote("f.bin", ("http://a/f.bin",), sha256=hashlib.sha256(BODY).hexdigest().upper())
    with pytest.raises(DatasetError) as err:
        download.fetch(remote, tmp_path)
    assert str(err.value) == (f"could not download f.bin (http://a/f.bin: checksum mismatch (sha256 "
                              f"{hashlib.sha256(b'other').hexdigest()}, expected {hashlib.sha256(BODY).hexdigest()}), "
                              "discarded)")
