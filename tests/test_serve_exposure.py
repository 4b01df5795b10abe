"""The app on a Serve instance that listens beyond loopback: refused without API tokens, served
with them (real HTTP, on 127.0.0.1, to a proxy bound to every interface)."""

from __future__ import annotations

import httpx
import pytest

from services import auth
from tests.conftest import free_port


def test_an_open_api_is_refused_beyond_loopback_and_served_with_tokens(tiny_trained, tmp_path):
    from ray import serve

    from services.app import build_app

    port = free_port()
    serve.start(http_options={"host": "0.0.0.0", "port": port})
    settings = {
        "manifest_uri": tiny_trained["states"]["user_states"],
        "store_uri": str(tmp_path / "store"),
        "shards": 1,
    }
    try:
        with pytest.raises(RuntimeError, match=r"Failed to update the deployments \['Ingress'\]"):
            serve.run(build_app(settings), name="kvrank", route_prefix="/")
        # why, where an operator reads it (serve status)
        why = serve.status().applications["kvrank"].deployments["Ingress"].message
        assert "Serve listens on '0.0.0.0' and no api_tokens_file is set" in why, why
        serve.delete("kvrank")
        (tmp_path / "tokens").write_text(f"{auth.digest('t-read')} read reader\n")
        settings["api_tokens_file"] = str(tmp_path / "tokens")
        serve.run(build_app(settings), name="kvrank", route_prefix="/")
        body = {"user_id": 1, "candidate_item_ids": [1, 2, 3], "k": 2}
        url = f"http://127.0.0.1:{port}/v1/rank"
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        ok = httpx.post(url, json=body, headers={"Authorization": "Bearer t-read"}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        serve.shutdown()
