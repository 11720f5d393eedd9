"""`ovt-trainer certs` writes a usable self-signed certificate and refuses to overwrite it."""

from __future__ import annotations

import stat

from trainer_node.cli import main


def test_certs_are_written_once(tmp_path, capsys):
    out = tmp_path / "tls"
    assert main(["certs", "--out", str(out)]) == 0
    assert (out / "cert.pem").read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert stat.S_IMODE((out / "key.pem").stat().st_mode) == 0o600
    assert main(["certs", "--out", str(out)]) == 2
    assert "not overwriting" in capsys.readouterr().err
