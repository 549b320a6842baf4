"""Every session Sluicegate opens ends when its peer stops answering (a cut network): libpq's keepalives and
TCP_USER_TIMEOUT on the client, the same on the server's side of the session; a URL's own values win."""

from __future__ import annotations

from sluicegate.postgres.connect import LIVENESS, SESSION_OPTIONS, liveness, session_options


def test_defaults_on_both_sides():
    client, server = liveness("postgresql://u@h:5432/db")
    assert client == LIVENESS
    assert server == ("-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=4 "
                      "-c tcp_user_timeout=30000")


def test_the_urls_own_values_win_on_both_sides():
    client, server = liveness("postgresql://u@h/db?keepalives_idle=2&tcp_user_timeout=4000")
    assert "keepalives_idle" not in client and "tcp_user_timeout" not in client
    assert client["keepalives_count"] == "4"
    assert "tcp_keepalives_idle=2 " in server and server.endswith("tcp_user_timeout=4000")


def test_keepalives_turned_off_in_the_url_adds_nothing():
    assert liveness("host=h dbname=db keepalives=0") == ({}, "")


def test_session_options_keep_the_output_settings_and_add_extra():
    opts = session_options("postgresql://u@h/db", "-c logical_decoding_work_mem=64kB")
    assert opts["options"].startswith(SESSION_OPTIONS)
    assert opts["options"].endswith("-c logical_decoding_work_mem=64kB") and "tcp_user_timeout=30000" in opts["options"]
