"""`luwu certs`: a certificate authority and the certificates of P4Runtime's mutual TLS.

`luwu certs init DIR` makes a CA (`DIR/ca.key`, 0600, and the self-signed `DIR/ca.pem`);
`luwu certs issue NAME --role controller|reader --ca DIR --out DIR` a client certificate that CA
signs (`OUT/NAME.pem`, `OUT/NAME.key`), and `luwu certs issue NAME --server --dns HOST --ip ADDR`
a switch's server certificate. A client certificate names its holder in its subject
(CN=NAME, OU=ROLE) and its role in a SAN URI, `urn:luwu:role:ROLE`: the URI is what a
`luwu switch --p4runtime-tls-client-ca` reads (dataplane/switch/p4runtime_auth.py), so any CA
can issue certificates for luwu's roles. Keys are ECDSA P-256 (what gRPC, BoringSSL and OpenSSL
all take), certificates SHA-256 signed; built with the `cryptography` library.

    luwu certs init pki
    luwu certs issue switch1 --server --dns localhost --ip 127.0.0.1 --ca pki --out pki
    luwu certs issue ops --role controller --ca pki --out pki
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from luwu.dataplane.p4runtime import CERT_ROLES, ROLE_URI_PREFIX
from luwu.dataplane.process.usage import UserError, positive_int

DEFAULT_CA_DAYS = 3650
DEFAULT_DAYS = 825  # the longest validity browsers and most TLS stacks accept for a leaf
CA_KEY, CA_CERT = "ca.key", "ca.pem"
BACKDATE = datetime.timedelta(minutes=5)  # tolerate clocks a little behind the issuer's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="make a CA: DIR/ca.key (0600) and the self-signed DIR/ca.pem")
    init.add_argument("dir", help="folder for the CA (made if missing; an existing CA there is never overwritten)")
    init.add_argument("--name", default="luwu CA", help="the CA's common name (default: 'luwu CA')")
    init.add_argument("--days", type=positive_int, default=DEFAULT_CA_DAYS, help=f"validity (default {DEFAULT_CA_DAYS})")
    issue = sub.add_parser("issue", help="a client certificate with a role, or a server certificate, signed by the CA")
    issue.add_argument("name", help="who holds it: the certificate's CN and the files' name (OUT/NAME.pem, .key)")
    kind = issue.add_mutually_exclusive_group(required=True)
    kind.add_argument("--role", choices=CERT_ROLES, help="a client certificate: controller (write, set the pipeline, "
                                                         "become primary) or reader (read only)")
    kind.add_argument("--server", action="store_true", help="a server certificate (a switch's P4Runtime), for the "
                                                            "names in --dns/--ip")
    issue.add_argument("--dns", action="append", default=[], metavar="NAME", help="DNS name in the SAN (repeatable)")
    issue.add_argument("--ip", action="append", default=[], metavar="ADDR", help="IP address in the SAN (repeatable)")
    issue.add_argument("--ca", required=True, metavar="DIR", help="the CA folder of `luwu certs init`")
    issue.add_argument("--out", required=True, metavar="DIR", help="folder for NAME.pem and NAME.key (made if missing)")
    issue.add_argument("--days", type=positive_int, default=DEFAULT_DAYS, help=f"validity (default {DEFAULT_DAYS})")
    issue.add_argument("--force", action="store_true", help="overwrite an existing NAME.pem/NAME.key")


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write a new file (0600 for keys, set before any byte is written)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make folder {out}: {e.strerror}") from None
    return out


def init_ca(folder: str | Path, name: str = "luwu CA", days: int = DEFAULT_CA_DAYS) -> tuple[Path, Path]:
    """Make a CA in `folder`: a new P-256 key (`ca.key`, 0600) and its self-signed certificate (`ca.pem`).

    Args:
        folder: made if missing; a CA already there is refused (UserError), never overwritten.
        name: the CA's common name.
        days: validity.

    Returns:
        (certificate path, key path).

    Example:
        >>> cert, key = init_ca("pki")
    """
    out = _out_dir(str(folder))
    cert_path, key_path = out / CA_CERT, out / CA_KEY
    if cert_path.exists() or key_path.exists():
        raise UserError(f"{out} already holds a CA ({CA_CERT}/{CA_KEY}): remove them or choose another folder")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _load_ca(folder: str | Path):
    ca = Path(folder)
    try:
        cert = x509.load_pem_x509_certificate((ca / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((ca / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError as e:
        raise UserError(f"--ca {ca}: no {Path(e.filename).name} there: make the CA with `luwu certs init {ca}`") \
            from None
    except (ValueError, TypeError) as e:
        raise UserError(f"--ca {ca}: not a CA of `luwu certs init` ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise UserError(f"--ca {ca}: cannot read it ({e.strerror})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise UserError(f"--ca {ca}: {CA_KEY} is not an EC key of `luwu certs init`")
    return cert, key


def issue(name: str, ca: str | Path, out: str | Path, role: str | None = None, server: bool = False,
          dns: list[str] | tuple[str, ...] = (), ips: list[str] | tuple[str, ...] = (), days: int = DEFAULT_DAYS,
          force: bool = False) -> tuple[Path, Path]:
    """Issue `out/NAME.pem` and `out/NAME.key` (0600), signed by the CA in `ca`.

    Args:
        name: the holder: the certificate's CN and the files' name.
        ca: a folder made by `init_ca`.
        out: where the files go (made if missing).
        role: a client certificate with this role (`controller` or `reader`; OU=ROLE and the SAN
            URI `urn:luwu:role:ROLE`, which the switch maps to what the holder may do).
        server: a server certificate instead (serverAuth, for the `dns` names and `ips`).
        dns, ips: subject alternative names (a server certificate needs at least one).
        days: validity.
        force: overwrite existing files.

    Returns:
        (certificate path, key path).

    Example:
        >>> issue("ops", "pki", "pki", role="controller")
    """
    if not name or "/" in name or name.startswith(".") or len(name) > 64:
        raise UserError(f"certificate name {name!r}: use 1 to 64 characters without '/' and not starting with '.'")
    if (role is None) == (not server):
        raise UserError("give --role controller|reader (a client certificate) or --server, not both")
    if role is not None and role not in CERT_ROLES:
        raise UserError(f"--role {role!r}: one of {', '.join(CERT_ROLES)}")
    try:
        addresses = [ipaddress.ip_address(a) for a in ips]
    except ValueError as e:
        raise UserError(f"--ip: {e}") from None
    for d in dns:
        if not d or any(c.isspace() or c in "/:@" for c in d):
            raise UserError(f"--dns {d!r}: not a host name")
    if server and not dns and not addresses:
        raise UserError("a --server certificate needs the names clients dial: --dns NAME and/or --ip ADDR")
    ca_cert, ca_key = _load_ca(ca)
    folder = _out_dir(str(out))
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    if not force and (cert_path.exists() or key_path.exists()):
        raise UserError(f"{cert_path} or {key_path} exists: pass --force to replace them")
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
    if role:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns] + [x509.IPAddress(a) for a in addresses]
    if role:
        sans.append(x509.UniformResourceIdentifier(ROLE_URI_PREFIX + role))
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_agreement=True,
                                            content_commitment=False, data_encipherment=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def run(args: argparse.Namespace) -> int:
    if args.action == "init":
        cert, key = init_ca(args.dir, args.name, args.days)
        print(f"CA: {cert} (give it to clients and to `luwu switch --p4runtime-tls-client-ca`); key: {key} "
              f"(keep it private)")
        return 0
    cert, key = issue(args.name, args.ca, args.out, role=args.role, server=args.server, dns=args.dns, ips=args.ip,
                      days=args.days, force=args.force)
    what = "server certificate" if args.server else f"client certificate, role {args.role}"
    print(f"{what}: {cert}; key: {key}")
    return 0
