"""The app's API tokens (services.auth) without a Serve: made, read, rotated and refused as the
operators' guide says; the Serve tests (tests/test_serve.py) check them over HTTP."""

from __future__ import annotations

import pytest

from services import auth


def test_tokens_are_made_checked_and_refused_as_the_operators_guide_says(tmp_path, capsys):
    """``python -m services.auth new`` makes a token and its line; a tokens file is read again
    when it changes (a rotation) and a bad edit keeps the last good set; an open API on a
    non-loopback host is refused."""
    from models.errors import InputError

    assert auth.main(["new", "--scopes", "read,write", "--name", "web"]) == 0
    out, err = capsys.readouterr()
    token = err.strip().rsplit(" ", 1)[1]
    assert out.strip() == f"{auth.digest(token)} read,write web"
    path = tmp_path / "tokens"
    path.write_text(out)
    tokens = auth.Tokens(str(path))
    assert tokens.scopes(token) == (frozenset({"read", "write"}), "web")
    assert tokens.scopes(token + "x") is None and tokens.scopes("") is None
    assert auth.main(["new", "--scopes", "read,root"]) == 2
    assert "scopes must be among read, write, admin, got 'read,root'" in capsys.readouterr().err
    # rotation: the new token's line in, the old one's out; the file is read again
    assert auth.main(["new", "--scopes", "admin"]) == 0
    new_out, new_err = capsys.readouterr()
    path.write_text(new_out + "# rotated\n")
    new_token = new_err.strip().rsplit(" ", 1)[1]
    assert tokens.scopes(token) is None
    assert tokens.scopes(new_token) == (frozenset({"admin"}), "line 1")
    path.write_text("deadbeef read\n")  # a bad edit: the last good set stays
    assert tokens.scopes(new_token) == (frozenset({"admin"}), "line 1")
    with pytest.raises(InputError, match="line 1: the first field must be a token's sha256"):
        auth.Tokens(str(path))
    for host in ("127.0.0.1", "::1", "localhost"):
        auth.check_exposure(host, None)
    auth.check_exposure("0.0.0.0", str(path))
    for host in ("0.0.0.0", "10.1.2.3", "kvrank.internal"):
        with pytest.raises(InputError, match=f"Serve listens on '{host}' and no api_tokens_file"):
            auth.check_exposure(host, None)
    assert [auth.scope_of(p) for p in ("/healthz", "/docs", "/v1/rank", "/v1/users/3")] == [
        None,
        None,
        "read",
        "admin",
    ]
    assert auth.scope_of("/v1/rankings") == "admin" and auth.scope_of("/api/v1/rank", "/api") == (
        "read"
    )
