"""Optional encryption of tcp sockets with ZeroMQ CURVE, the key pair from a file.

A cluster that asks for it (``curve_key_file``, ``--curve-key-file``) shares one CURVE
key pair: a file holding its secret key as 40 z85 characters (``nereus curve-key
FILE`` writes one, mode 0600); the public key is derived from it. Every socket bound
to a ``tcp://`` address (the controller, tcp workers, the tap) serves with that pair
and accepts only clients that present the same public key (one ZAP handler per
process checks them); every socket connecting to a ``tcp://`` address uses the pair
and expects the server's key to be the same public key. So a host without the file
can neither read the traffic nor finish a connection: libzmq drops it before a single
message is buffered. ``ipc://`` sockets and the same-host stream socket stay plain
(their files are mode 0600 on one host).

CURVE adds confidentiality and a connection-level check; the HMAC of every message
(``_wire``, ``_session``) is kept either way. Refuses: a file that does not hold a
z85 secret key (``ConfigError`` naming it), CURVE on a libzmq built without it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from nereus.errors import ConfigError, exit_status

__all__ = ["CurveKey", "load_curve", "generate_curve", "secure", "stop_authenticators", "main"]

_Z85_KEY_CHARS = 40


@dataclass(frozen=True)
class CurveKey:
    """The cluster's CURVE key pair (z85 text, 40 bytes each)."""

    secret: bytes
    public: bytes

    def __post_init__(self) -> None:
        for name in ("secret", "public"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != _Z85_KEY_CHARS:
                raise ConfigError(f"CurveKey.{name} must be {_Z85_KEY_CHARS} z85 characters")

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKey(public={self.public.decode()!r})"


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise ConfigError("CURVE encryption was asked for, but this libzmq was built without it")


def curve_from_secret(secret: bytes, where: str) -> CurveKey:
    """The key pair of a z85 ``secret`` (``where`` names its source in errors)."""
    _require_curve()
    secret = secret.strip()
    try:
        public = zmq.curve_public(secret)
    except (ValueError, zmq.ZMQError) as e:
        raise ConfigError(
            f"{where} does not hold a CURVE secret key ({_Z85_KEY_CHARS} z85 "
            f"characters, e.g. from `nereus curve-key FILE`): {e}"
        ) from None
    return CurveKey(secret, public)


def load_curve(path: str | os.PathLike) -> CurveKey:
    """The key pair whose secret key ``path`` holds."""
    try:
        secret = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"curve_key_file={str(path)!r} cannot be read: {e.strerror}") from None
    return curve_from_secret(secret, f"curve_key_file={str(path)!r}")


def generate_curve(path: str | os.PathLike) -> CurveKey:
    """Write a fresh secret key to ``path`` (mode 0600, never overwrites a file)."""
    _require_curve()
    public, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret + b"\n")
    return CurveKey(secret, public)


class _OnlyClusterKey:
    """ZAP credentials provider: the one public key of the cluster."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


_AUTH: dict[int, Any] = {}  # id(context) -> ThreadAuthenticator
_AUTH_LOCK = threading.Lock()


def _authenticate(ctx: zmq.Context, curve: CurveKey) -> None:
    """Start this context's ZAP handler (once) admitting only the cluster's key."""
    from zmq.auth.thread import ThreadAuthenticator

    with _AUTH_LOCK:
        auth = _AUTH.get(id(ctx))
        if auth is None:
            auth = _AUTH[id(ctx)] = ThreadAuthenticator(ctx)
            auth.start()
        auth.configure_curve_callback("*", credentials_provider=_OnlyClusterKey(curve.public))


def secure(sock: zmq.Socket, curve: CurveKey | None, address: str, *, server: bool) -> None:
    """Make ``sock`` a CURVE server or client when ``curve`` is given and ``address``
    is tcp (both ends decide from the same address, so they always agree). Call it
    before ``bind``/``connect``."""
    if curve is None or not address.startswith("tcp://"):
        return
    sock.curve_secretkey = curve.secret
    sock.curve_publickey = curve.public
    if server:
        _authenticate(sock.context, curve)
        sock.curve_server = True
    else:
        sock.curve_serverkey = curve.public


def stop_authenticators() -> None:
    """Stop every ZAP handler this process started (at shutdown, and in tests)."""
    with _AUTH_LOCK:
        auths = list(_AUTH.values())
        _AUTH.clear()
    for auth in auths:
        auth.stop()


def main(argv: list[str] | None = None) -> int:
    """``nereus curve-key FILE``: write a fresh CURVE secret key (mode 0600)."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="nereus curve-key", description=main.__doc__)
    ap.add_argument("file", help="where to write the secret key; it must not exist")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    def write() -> None:
        curve = generate_curve(args.file)
        print(f"wrote {args.file}; public key {curve.public.decode()}")

    return exit_status("nereus curve-key", write, usage=(ConfigError, OSError))
