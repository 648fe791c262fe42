"""A p4runtime-shell session against a `luwu switch`, run with p4runtime-shell's own venv (it pins
protobuf 3.20): mutual TLS with certificates from `luwu certs`, nothing else. Prints one JSON
object of what it saw. p4/README.md ("Connect with finsy, p4runtime-shell, the P4Runtime
CLI") shows the same statements.

    python p4rt_shell_session.py controller ADDR CA CERT KEY P4INFO DEVICE_CONFIG
    python p4rt_shell_session.py reader ADDR CA CERT KEY
"""

import json
import sys

import p4runtime_sh.shell as sh
from p4runtime_sh.p4runtime import P4RuntimeWriteException, SSLOptions


def _port(replica):
    """A replica's port, in whichever field the switch answered (this shell writes `egress_port`)."""
    if replica.WhichOneof("port_kind") == "port":
        return int.from_bytes(replica.port, "big")
    return replica.egress_port


def controller(addr, ca, cert, key, p4info, device_config):
    sh.setup(device_id=0, grpc_addr=addr, election_id=(0, 1), config=sh.FwdPipeConfig(p4info, device_config),
             ssl_options=SSLOptions(insecure=False, cacert=ca, cert=cert, key=key), verbose=False)
    out = {}
    try:
        te = sh.TableEntry("ipv4_lpm")(action="ipv4_forward")
        te.match["dst_addr"] = "10.0.1.0/24"
        te.action["port"] = "3"
        te.action["dst_mac"] = "02:00:00:00:01:03"
        te.insert()
        out["entries"] = [[e.match["dst_addr"].lpm.prefix_len, e.action["port"].value.hex()]
                          for e in sh.TableEntry("ipv4_lpm").read()]
        mcg = sh.MulticastGroupEntry(7).add(1, 0).add(2, 0)
        mcg.insert()
        out["groups"] = [[g.group_id, [[_port(r), r.instance] for r in g.msg().multicast_group_entry.replicas]]
                         for g in sh.MulticastGroupEntry(7).read()]
        te.delete()
        mcg.delete()
        out["after_delete"] = [len(list(sh.TableEntry("ipv4_lpm").read())), len(list(sh.MulticastGroupEntry(7).read()))]
    finally:
        sh.teardown()
    return out


def reader(addr, ca, cert, key):
    sh.setup(device_id=0, grpc_addr=addr, election_id=(0, 1), config=None,
             ssl_options=SSLOptions(insecure=False, cacert=ca, cert=cert, key=key), verbose=False)
    out = {}
    try:
        out["entries"] = len(list(sh.TableEntry("ipv4_lpm").read()))
        te = sh.TableEntry("ipv4_lpm")(action="drop")
        te.match["dst_addr"] = "10.0.2.0/24"
        try:
            te.insert()
            out["write"] = "OK"
        except P4RuntimeWriteException as e:
            out["write"] = str(e)
        except Exception as e:  # the refusal of the whole request: a gRPC error, as the shell raises it
            out["write"] = f"{type(e).__name__}: {e}"
    finally:
        sh.teardown()
    return out


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    print(json.dumps(controller(*rest) if mode == "controller" else reader(*rest)), flush=True)
