"""TLS: with --tls-cert/--tls-key the controller speaks TLS only; clients verify it with the CA."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest
from ctl_helpers import ADMIN

from luwu.controller.client import ControllerClient, ControllerUnreachable
from luwu.controller.server import BackgroundController


@pytest.fixture
def self_signed(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=luwu-test",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_controller(controller_config, self_signed):
    cert, key = self_signed
    bc = BackgroundController(dataclasses.replace(controller_config, tls_cert=str(cert), tls_key=str(key)))
    try:
        with ControllerClient(bc.address, ADMIN, tls_ca=str(cert)) as secure:
            assert secure.status().switches == 0
        with ControllerClient(bc.address, ADMIN, timeout=3) as plaintext, pytest.raises(ControllerUnreachable):
            plaintext.status()
    finally:
        bc.stop()


def test_tls_needs_both_files(controller_config, self_signed):
    cert, _ = self_signed
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        BackgroundController(dataclasses.replace(controller_config, tls_cert=str(cert)))
