"""gpu-verify's connection: a host that is both down and new to known_hosts is said to be
unreachable (what is wrong), not to have an unknown host key (remote/ship.py, check_reachable)."""

from __future__ import annotations

import socket

import pytest

from vllm_repro.errors import EnvError
from vllm_repro.remote.ship import Ship, connect


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_a_down_and_new_host_is_unreachable_not_an_unknown_key(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu-box\n  HostName 127.0.0.1\n  Port {closed_port()}\n"
                      f"  UserKnownHostsFile {tmp_path / 'known_hosts'}\n")
    ship = Ship(host="gpu-box", bundle=tmp_path, local=tmp_path, ssh_config=config,
                connect_timeout=5)
    with pytest.raises(EnvError) as exc:
        connect(ship)
    message = str(exc.value)
    assert message.startswith("cannot reach gpu-box (127.0.0.1:") and "connection refused" in message
    assert "host key" not in message
    assert not (tmp_path / "known_hosts").exists()
