"""P4 users' own clients against `luwu switch`, authenticated only by certificates from `luwu certs`.

A CA and certificates made with the `luwu certs` command; a `luwu switch` process with mutual TLS
and no bearer token; stock finsy (its own `GRPCCredentialsTLS`) and p4runtime-shell 0.0.6 (in its
own venv: it pins protobuf 3.20) set the pipeline, write a table entry and a multicast group, read
them back and delete them; a `reader` certificate may read but its writes are PERMISSION_DENIED;
a client without a certificate of the CA gets no connection at all; the audit log names the
certificate. The commands are the ones p4/README.md ("Connect with finsy,
p4runtime-shell, the P4Runtime CLI") shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from finsy import (
    GRPCCredentialsTLS,
    GRPCStatusCode,
    P4ClientError,
    P4MulticastGroupEntry,
    P4TableAction,
    P4TableEntry,
    P4TableMatch,
    Switch,
    SwitchOptions,
)
from finsy.proto import p4r, p4r_grpc
from p4rt_shell_venv import ensure as p4runtime_shell_python

from luwu.dataplane.switch.p4runtime_auth import P4RuntimeAuth, certificate_identity, check_transport
from luwu.p4 import P4INFO_TXTPB

HERE = Path(__file__).resolve().parent
BMV2_JSON = Path(P4INFO_TXTPB).with_name("luwu_v1model.json")  # the device config a P4 user has at hand
STAR4 = Path(P4INFO_TXTPB).parent.parent / "runtime" / "star4.json"  # `luwu p4 load`'s example runtime
TIMEOUT = 30.0  # s, an upper bound for any exchange (never an assertion on speed)
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def luwu(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "luwu.cli", *args], capture_output=True, text=True, timeout=120,
                          env=ENV)
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """`luwu certs`: a CA, the switch's server certificate and a controller and a reader client certificate;
    and a second CA with a controller certificate of its own (`foreign/`)."""
    pki = tmp_path_factory.mktemp("pki")
    luwu("certs", "init", str(pki))
    luwu("certs", "issue", "switch1", "--server", "--dns", "localhost", "--ip", "127.0.0.1", "--ca", str(pki),
         "--out", str(pki))
    luwu("certs", "issue", "ops", "--role", "controller", "--ca", str(pki), "--out", str(pki))
    luwu("certs", "issue", "viewer", "--role", "reader", "--ca", str(pki), "--out", str(pki))
    luwu("certs", "init", str(pki / "foreign"))
    luwu("certs", "issue", "intruder", "--role", "controller", "--ca", str(pki / "foreign"), "--out",
         str(pki / "foreign"))
    return pki


@pytest.fixture
def luwu_switch(pki, tmp_path):
    """A `luwu switch` process whose P4Runtime admits clients by certificate only; (address, audit log)."""
    audit = tmp_path / "audit.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "luwu.cli", "switch", "--port", "1=127.0.0.1:0", "--port",
                             "2=127.0.0.1:0", "--p4runtime", "127.0.0.1:0",
                             "--p4runtime-tls-cert", str(pki / "switch1.pem"),
                             "--p4runtime-tls-key", str(pki / "switch1.key"),
                             "--p4runtime-tls-client-ca", str(pki / "ca.pem"), "--audit-log", str(audit)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith('{"ready": true'), line + proc.stderr.read()
        yield json.loads(line)["p4runtime"], audit
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def tls(pki: Path, who: str | None) -> GRPCCredentialsTLS:
    """finsy's own TLS credentials: the CA, and `who`'s certificate and key (None: no client certificate)."""
    return GRPCCredentialsTLS(cacert=pki / "ca.pem", cert=pki / f"{who}.pem" if who else None,
                              private_key=pki / f"{who}.key" if who else None)


def run(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT))
    finally:
        loop.close()


def test_luwu_certs_makes_a_ca_and_certificates_with_roles(pki):
    ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, role in (("ops", "controller"), ("viewer", "reader")):
        cert = x509.load_pem_x509_certificate((pki / f"{name}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [f"urn:luwu:role:{role}"]
        assert certificate_identity({"x509_pem_cert": [(pki / f"{name}.pem").read_bytes()]}) == (f"CN={name}", role)
        assert stat.S_IMODE((pki / f"{name}.key").stat().st_mode) == 0o600
    server = x509.load_pem_x509_certificate((pki / "switch1.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    # a certificate of the CA without a role grants nothing; with the token configured, the token still works
    roleless = {"x509_pem_cert": [(pki / "switch1.pem").read_bytes()]}
    assert certificate_identity(roleless) == ("CN=switch1", None)
    refusal = P4RuntimeAuth(None, certificates=True).admit((), roleless)
    assert isinstance(refusal, str) and "has no luwu role" in refusal
    both = P4RuntimeAuth("t", certificates=True)
    assert both.admit((("authorization", "Bearer t"),), roleless).role == "controller"
    assert both.admit((("authorization", "Bearer wrong"),), {"x509_pem_cert": [(pki / "ops.pem").read_bytes()]}) \
        == "wrong P4Runtime token for this switch"


def test_certificate_roles_need_mutual_tls():
    with pytest.raises(ValueError, match="admitting clients by certificate needs mutual TLS"):
        check_transport("127.0.0.1:9559", P4RuntimeAuth(None, certificates=True), tls=True, client_ca=False)
    check_transport("127.0.0.1:9559", P4RuntimeAuth(None, certificates=True), tls=True, client_ca=True)
    with pytest.raises(ValueError, match="needs a token, client certificates with roles, or both"):
        P4RuntimeAuth(None)


@pytest.mark.parametrize("args, needle", [
    (["issue", "x", "--role", "admin", "--ca", "CA", "--out", "OUT"], "invalid choice: 'admin'"),
    (["issue", "x", "--role", "reader", "--ca", "NOCA", "--out", "OUT"], "make the CA with `luwu certs init"),
    (["issue", "x", "--server", "--ca", "CA", "--out", "OUT"], "needs the names clients dial"),
    (["issue", "x", "--server", "--ip", "1.2.3.x", "--ca", "CA", "--out", "OUT"], "--ip: '1.2.3.x'"),
    (["init", "CA"], "already holds a CA"),
    ([], "missing command: one of init, issue"),
])
def test_luwu_certs_refuses_bad_input_in_one_line(pki, tmp_path, args, needle):
    args = [{"CA": str(pki), "NOCA": str(tmp_path / "none"), "OUT": str(tmp_path)}.get(a, a) for a in args]
    done = luwu("certs", *args, check=False)
    assert done.returncode == 2
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_stock_finsy_with_certificates_only(pki, luwu_switch):
    address, audit = luwu_switch
    def route():  # a new entity each time: finsy's +/- mark the entity itself
        return P4TableEntry("ipv4_lpm", match=P4TableMatch(dst_addr=(0x0A000100, 24)),
                            action=P4TableAction("ipv4_forward", port=3, dst_mac=0x020000000103))

    group = P4MulticastGroupEntry(7, replicas=[(1, 0), (2, 0)])

    async def body():
        opts = SwitchOptions(p4info=Path(P4INFO_TXTPB), p4blob=BMV2_JSON, device_id=0,
                             channel_credentials=tls(pki, "ops"))
        seen = {}
        async with Switch("s1", address, opts) as sw:  # sets the pipeline: finsy is primary
            await sw.write([+route(), +group])
            seen["routes"] = [e async for e in sw.read(P4TableEntry("ipv4_lpm"))]
            seen["groups"] = [g async for g in sw.read(P4MulticastGroupEntry(7))]
            # a reader beside it: a backup that reads, and whose writes are refused
            ro = SwitchOptions(p4info=Path(P4INFO_TXTPB), device_id=0, initial_election_id=1,
                               channel_credentials=tls(pki, "viewer"))
            async with Switch("viewer", address, ro) as viewer:
                seen["reader_routes"] = [e async for e in viewer.read(P4TableEntry("ipv4_lpm"))]
                with pytest.raises(P4ClientError) as refused:
                    await viewer.write([-route()])
                seen["reader_write"] = (refused.value.code, str(refused.value))
            await sw.delete_all()
            seen["left"] = [e async for e in sw.read([P4TableEntry(), P4MulticastGroupEntry()])]
        return seen

    seen = run(body())
    assert [(e.match["dst_addr"], e.action.name, e.action.args) for e in seen["routes"]] == \
        [((0x0A000100, 24), "ipv4_forward", {"port": 3, "dst_mac": 0x020000000103})]
    assert [(g.multicast_group_id, list(g.replicas)) for g in seen["groups"]] == [(7, [1, 2])]  # instance 0: port
    assert len(seen["reader_routes"]) == 1
    code, message = seen["reader_write"]
    assert code == GRPCStatusCode.PERMISSION_DENIED, message
    assert "certificate CN=viewer has role 'reader'" in message
    assert seen["left"] == []
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    mine = [x for x in lines if x["who"]["identity"] == "certificate CN=ops"]
    assert {x["what"]["rpc"] for x in mine} == {"SetForwardingPipelineConfig", "Write"}
    assert all(x["who"]["role"] == "controller" for x in mine)
    refused = [x for x in lines if x["who"]["identity"] == "certificate CN=viewer"]
    assert len(refused) == 1 and refused[0]["result"].startswith("PERMISSION_DENIED")


def test_clients_without_a_certificate_of_the_ca_get_no_connection(pki, luwu_switch):
    address, _ = luwu_switch
    ca = (pki / "ca.pem").read_bytes()
    foreign = pki / "foreign"
    channels = {
        "no certificate": grpc.ssl_channel_credentials(ca),
        "another CA's certificate": grpc.ssl_channel_credentials(
            ca, (foreign / "intruder.key").read_bytes(), (foreign / "intruder.pem").read_bytes()),
        "plaintext with a bearer token": None,
    }
    for what, creds in channels.items():
        channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        with channel:
            stub = p4r_grpc.P4RuntimeStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Read(p4r.ReadRequest(device_id=0, entities=[p4r.Entity(table_entry=p4r.TableEntry())]),
                               metadata=(("authorization", "Bearer guess"),), timeout=TIMEOUT))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (what, err.value)
    # and with the reader's certificate, a write is refused by role, a read admitted
    creds = grpc.ssl_channel_credentials(ca, (pki / "viewer.key").read_bytes(), (pki / "viewer.pem").read_bytes())
    with grpc.secure_channel(address, creds) as channel:
        stub = p4r_grpc.P4RuntimeStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.SetForwardingPipelineConfig(p4r.SetForwardingPipelineConfigRequest(
                device_id=0, action=p4r.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT), timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:  # admitted: it only finds no pipeline yet
            stub.GetForwardingPipelineConfig(p4r.GetForwardingPipelineConfigRequest(device_id=0), timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_luwu_p4_load_with_certificates_only(pki, luwu_switch):
    """luwu's own P4Runtime CLI, `luwu p4 load`, with the controller's certificate; the reader's is refused in
    one line."""
    address, audit = luwu_switch

    def load(who: str) -> subprocess.CompletedProcess:
        return luwu("p4", "load", "--addr", address, "--runtime", str(STAR4), "--tls-ca", str(pki / "ca.pem"),
                    "--tls-cert", str(pki / f"{who}.pem"), "--tls-key", str(pki / f"{who}.key"), check=False)

    refused = load("viewer")
    assert refused.returncode == 1, refused.stderr
    assert "answered PERMISSION_DENIED" in refused.stderr and "role 'reader'" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    done = load("ops")
    assert done.returncode == 0, done.stderr
    assert "entities written" in done.stdout
    writes = [json.loads(x) for x in audit.read_text().splitlines()]
    assert sum(x["what"]["rpc"] == "Write" and x["result"] == "OK" and x["who"]["identity"] == "certificate CN=ops"
               for x in writes) > 3


@pytest.fixture(scope="module")
def shell_python() -> Path:
    python = p4runtime_shell_python()
    if isinstance(python, str):
        pytest.skip(f"p4runtime-shell's venv: {python} (needs network to PyPI once; then cached)")
    return python


def test_p4runtime_shell_with_certificates_only(pki, luwu_switch, shell_python):
    address, audit = luwu_switch

    def session(*args: str) -> dict:
        # -I: only the venv's packages (luwu's repository root has a `p4/` that would hide p4runtime's `p4`)
        done = subprocess.run([str(shell_python), "-I", str(HERE / "p4rt_shell_session.py"), *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    ops = session("controller", address, str(pki / "ca.pem"), str(pki / "ops.pem"), str(pki / "ops.key"),
                  str(P4INFO_TXTPB), str(BMV2_JSON))
    assert ops == {"entries": [[24, "03"]], "groups": [[7, [[1, 0], [2, 0]]]], "after_delete": [0, 0]}
    viewer = session("reader", address, str(pki / "ca.pem"), str(pki / "viewer.pem"), str(pki / "viewer.key"))
    assert viewer["entries"] == 0
    assert "PERMISSION_DENIED" in viewer["write"] and "role 'reader'" in viewer["write"]
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [x["what"].get("type", x["what"]["rpc"]) for x in lines if x["who"]["identity"] == "certificate CN=ops"] \
        == ["SetForwardingPipelineConfig", "INSERT", "INSERT", "DELETE", "DELETE"]
