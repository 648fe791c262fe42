"""The software switch's P4Runtime is the controller's alone: a client without the switch's token (or
with another role) can neither become primary, nor wipe tables, nor insert or read entries; the
controller programs it with the derived token, over loopback or mutual TLS; and what a client
with valid credentials changes behind the controller's back is found and repaired as drift."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import threading
import urllib.request

import grpc
import pytest
from ctl_helpers import ADMIN, LANES, SLOTS, job, node, star_switch
from finsy import P4TableAction, P4TableEntry, P4TableMatch, Switch, SwitchOptions
from finsy.proto import U128, p4r, p4r_grpc

from luwu.controller.client import ControllerClient
from luwu.controller.server import BackgroundController
from luwu.dataplane.p4runtime import switch_token
from luwu.dataplane.p4runtime.credentials import switch_credentials
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig
from luwu.dataplane.switch.p4runtime_auth import P4RuntimeAuth, check_transport, server_credentials
from luwu.dataplane.switch.p4runtime_server import serve

TOKEN = switch_token(ADMIN, "s1")
FULL_DROP = 0xFFFFFFFF  # drop_sim threshold of a 100% drop rule


@pytest.fixture
def guarded(p4info):
    """factory(**serve_kw) -> (SoftwareSwitch, address) serving P4Runtime with the token of "s1"."""
    handles = []

    def make(**kw):
        sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
        kw.setdefault("auth", P4RuntimeAuth(TOKEN))
        h = serve(sw, "127.0.0.1:0", p4info, device_id=0, **kw)
        handles.append(h)
        return sw, h.address

    yield make
    for h in handles:
        h.stop()


def table_rows(sw) -> dict[str, list]:
    """The managed tables' entries, in a canonical order."""
    return {t: sorted(sw.tables.entries(t), key=repr) for t in ("sessions", "workers", "endpoints", "ingress_drop_sim")}


def deploy(bc, admin, address):
    admin.register_node(node("n0"))
    assert admin.register_switch(star_switch("s1", address, 2, ["n0"])).message == "registered and programmed"
    return admin.create_job(job("a", 2, [100, 200]))


def attacker_calls(address: str, metadata=()) -> dict[str, grpc.StatusCode]:
    """Every write path an intruder would try, over a plain channel; {call: status code}."""
    codes = {}
    with grpc.insecure_channel(address) as channel:
        stub = p4r_grpc.P4RuntimeStub(channel)
        election = U128.encode(1 << 60)  # higher than any controller's
        arbitration = p4r.StreamMessageRequest(arbitration=p4r.MasterArbitrationUpdate(device_id=0,
                                                                                       election_id=election))
        try:
            next(iter(stub.StreamChannel(iter([arbitration]), metadata=metadata, timeout=10)))
            codes["StreamChannel"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            codes["StreamChannel"] = exc.code()
        calls = {
            "SetForwardingPipelineConfig": (stub.SetForwardingPipelineConfig, p4r.SetForwardingPipelineConfigRequest(
                device_id=0, election_id=election, action=p4r.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT)),
            "Write": (stub.Write, p4r.WriteRequest(device_id=0, election_id=election, updates=[p4r.Update(
                type=p4r.Update.DELETE, entity=p4r.Entity(table_entry=p4r.TableEntry()))])),
            "Read": (lambda r, **kw: list(stub.Read(r, **kw)), p4r.ReadRequest(device_id=0, entities=[
                p4r.Entity(table_entry=p4r.TableEntry())])),
        }
        for name, (call, request) in calls.items():
            try:
                call(request, metadata=metadata, timeout=10)
                codes[name] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                codes[name] = exc.code()
    return codes


def test_unauthenticated_clients_change_nothing(controller, guarded):
    bc, admin = controller
    sw, address = guarded()
    deploy(bc, admin, address)
    before = table_rows(sw)
    assert before["sessions"] and before["endpoints"]
    for metadata in ((), (("authorization", "Bearer not-the-token"),), (("authorization", TOKEN),)):
        codes = attacker_calls(address, metadata)
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    assert table_rows(sw) == before
    assert sw.tables.multicast_groups()
    # the controller is still primary-capable and in charge: re-programming is a no-op
    assert bc.call(bc.server.core.check_drift(), 60) == {}


def test_a_foreign_role_may_not_arbitrate(guarded):
    _, address = guarded()
    md = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.secure_channel(address, grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)) as ch:
        stub = p4r_grpc.P4RuntimeStub(ch)
        request = p4r.StreamMessageRequest(arbitration=p4r.MasterArbitrationUpdate(
            device_id=0, election_id=U128.encode(5), role=p4r.Role(name="intruder")))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StreamChannel(iter([request]), metadata=md, timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "role 'intruder' is not configured" in err.value.details()


def test_token_in_clear_text_beyond_loopback_is_refused():
    with pytest.raises(ValueError, match="without TLS would carry its token in clear text"):
        check_transport("10.0.0.1:50051", P4RuntimeAuth("t"), tls=False)
    check_transport("10.0.0.1:50051", P4RuntimeAuth("t"), tls=True)
    check_transport("127.0.0.1:50051", P4RuntimeAuth("t"), tls=False)


async def operator_mistake(address: str, p4info) -> None:
    """A second client with valid credentials: a 100% drop rule on port 1 and one of the
    controller's `sessions` entries deleted."""
    opts = SwitchOptions(p4info=p4info, device_id=0, initial_election_id=1 << 40,
                         channel_credentials=switch_credentials(address, TOKEN, None))
    async with Switch("operator", address, opts) as sw:
        sessions = [e async for e in sw.read(P4TableEntry("sessions"))]
        await sw.write([+P4TableEntry("ingress_drop_sim", match=P4TableMatch(port=1),
                                      action=P4TableAction("set_ingress_drop_rate", threshold=FULL_DROP)),
                        -sessions[0]])


def test_drift_is_reported_and_repaired(controller_config, guarded, p4info):
    sw, address = guarded()
    bc = BackgroundController(dataclasses.replace(controller_config, reconcile_interval=0.2, metrics="127.0.0.1:0"))
    admin = ControllerClient(bc.address, ADMIN)
    try:
        deploy(bc, admin, address)
        programmed = table_rows(sw)
        assert programmed["ingress_drop_sim"] == []
        bc.call(operator_mistake(address, p4info), 60)
        assert sw.tables.lookup("ingress_drop_sim", {"port": 1}) is not None
        assert len(sw.tables.entries("sessions")) == len(programmed["sessions"]) - 1
        drift = "none"
        for _ in range(200):  # bounded: the loop runs every 0.2 s; a few rounds are enough
            drift = admin.switches()[0].drift
            if drift != "none" and drift:
                break
            threading.Event().wait(0.1)
        assert "1 unexpected entry deleted (ingress_drop_sim)" in drift
        assert "1 missing entry re-inserted (sessions)" in drift
        assert table_rows(sw) == programmed
        assert admin.switches()[0].programmed == "ok"
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://{bc.server.metrics_address}/metrics", timeout=10).read().decode()
        repairs = {s.labels["switch"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "luwu_controller_drift_repairs_total"}
        assert repairs[admin.switches()[0].name] >= 1  # luwu controller --metrics counts the repair
    finally:
        admin.close()
        bc.stop()


def test_declared_simulated_loss_is_kept(controller, guarded):
    bc, admin = controller
    sw, address = guarded()
    sw.set_drop_sim(1, ingress=0.25)
    from luwu.controller.client import software_switch_record

    sw.attach_udp(1, ("127.0.0.1", 0))
    admin.register_switch(software_switch_record(sw, "s1", address))
    kept = sw.tables.lookup("ingress_drop_sim", {"port": 1})
    assert kept is not None and kept["params"]["threshold"] == 1 << 30
    assert bc.call(bc.server.core.check_drift(), 60) == {}
    assert sw.tables.lookup("ingress_drop_sim", {"port": 1}) == kept


@pytest.fixture
def pki(tmp_path):
    """A CA, a switch certificate for 127.0.0.1 and a controller client certificate, both CA-signed."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ca_key, ca = tmp_path / "ca.key", tmp_path / "ca.pem"
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=luwu-test-ca", "-keyout",
        str(ca_key), "-out", str(ca))
    out = {"ca": ca}
    for who, san in (("switch", "IP:127.0.0.1"), ("controller", "DNS:luwu-controller")):
        key, csr, cert, ext = (tmp_path / f"{who}.{s}" for s in ("key", "csr", "pem", "ext"))
        ext.write_text(f"subjectAltName={san}\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", str(key), "-out", str(csr))
        run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "1",
            "-extfile", str(ext), "-out", str(cert))
        out[who] = (cert, key)
    return out


def test_mutual_tls(controller_config, guarded, pki):
    cert, key = pki["switch"]
    sw, address = guarded(credentials=server_credentials(str(cert), str(key), str(pki["ca"])))
    ccert, ckey = pki["controller"]
    secure = dataclasses.replace(controller_config, switch_tls_ca=str(pki["ca"]), switch_tls_cert=str(ccert),
                                 switch_tls_key=str(ckey))
    bc = BackgroundController(secure)
    try:
        with ControllerClient(bc.address, ADMIN) as admin:
            deploy(bc, admin, address)
            assert sw.tables.entries("sessions")
    finally:
        bc.stop()
    # without a client certificate the handshake fails: nothing is programmed
    no_cert = dataclasses.replace(controller_config, db=controller_config.db + "2", switch_tls_ca=str(pki["ca"]),
                                  program_timeout=5.0)
    bc = BackgroundController(no_cert)
    try:
        with ControllerClient(bc.address, ADMIN) as admin:
            admin.register_node(node("n0"))
            message = admin.register_switch(star_switch("s1", address, 2, ["n0"])).message
            assert message.startswith("registered; programming failed")
    finally:
        bc.stop()
    # and a plaintext client cannot even reach the RPCs
    assert set(attacker_calls(address, (("authorization", f"Bearer {TOKEN}"),)).values()) == \
        {grpc.StatusCode.UNAVAILABLE}
