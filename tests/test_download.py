"""ml-latest-small without a data directory: downloaded once into the user cache and checked
against the published sha256 sums. The "publisher" here is a local HTTP server on 127.0.0.1."""

from __future__ import annotations

import functools
import http.server
import os
import threading
import zipfile

import pytest

from pipelines.common import sources


@pytest.fixture()
def grouplens(tmp_path, data_dir, monkeypatch):
    """Serve a zip laid out like GroupLens' ml-latest-small.zip; returns a function that
    rewrites one file in it (to play a corrupted download)."""
    site = tmp_path / "site"
    site.mkdir()
    raw = os.path.join(data_dir, "ml-latest-small")

    def build(corrupt: str | None = None) -> None:
        with zipfile.ZipFile(site / "ml-latest-small.zip", "w") as zf:
            for name in sorted(os.listdir(raw)):
                data = open(os.path.join(raw, name), "rb").read()
                zf.writestr(f"ml-latest-small/{name}", data + (b"x" if name == corrupt else b""))

    build()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/ml-latest-small.zip"
    monkeypatch.setenv("KVRANK_ML_SMALL_URL", url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("KVRANK_DATA_DIR", raising=False)
    monkeypatch.setattr(sources, "data_dir", lambda explicit: None)
    yield build
    server.shutdown()


def test_download_is_checked_and_cached(grouplens, tmp_path):
    folder = sources.builtin_dir("ml-latest-small", None)
    assert folder == str(tmp_path / "cache" / "kvrank" / "ml-latest-small")
    src = sources.builtin("ml-latest-small", None)
    assert src.interactions.collect().height == 100_836
    # a second call uses the cache: even a now-broken publisher is not asked again
    grouplens(corrupt="ratings.csv")
    assert sources.builtin_dir("ml-latest-small", None) == folder


def test_corrupted_download_is_refused_and_not_cached(grouplens, tmp_path):
    grouplens(corrupt="movies.csv")
    with pytest.raises(sources.InputError, match="movies.csv has sha256 .* expected c47b783f"):
        sources.builtin_dir("ml-latest-small", None)
    assert not (tmp_path / "cache" / "kvrank" / "ml-latest-small").exists()


def test_amazon_is_never_downloaded(grouplens):
    with pytest.raises(sources.InputError, match="only ml-latest-small can be downloaded"):
        sources.builtin_dir("amazon-videogames-2018", None)
