"""Cluster keys: where they come from and how they are checked.

A cluster key is a shared secret of at least 16 bytes used to sign every message
(HMAC-SHA256). An optional CURVE key pair (``_curve``) encrypts tcp sockets; a node
hands its secret to its workers as ``$NEREUS_CURVE_SECRET`` (``curve_from_env``). It comes from, in
order: an explicit value, ``--key-file FILE`` (the file's contents, surrounding whitespace
stripped), or the environment variable
``NEREUS_CLUSTER_KEY``. ``Cluster.local`` generates a random one. Workers receive the
key through their environment, never on the command line (visible in ``ps``).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError

__all__ = ["KEY_ENV", "CURVE_ENV", "MIN_KEY_BYTES", "load_key", "generate_key", "curve_from_env"]

KEY_ENV = "NEREUS_CLUSTER_KEY"
CURVE_ENV = "NEREUS_CURVE_SECRET"
MIN_KEY_BYTES = 16


def generate_key() -> bytes:
    return secrets.token_hex(32).encode()


def load_key(key: str | bytes | None = None, key_file: str | None = None) -> bytes:
    """The cluster key from ``key``, else ``key_file``, else ``$NEREUS_CLUSTER_KEY``."""
    if key is not None:
        value = key.encode() if isinstance(key, str) else bytes(key)
        where = "key"
    elif key_file is not None:
        try:
            value = Path(key_file).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"key_file={key_file!r} cannot be read: {e.strerror}") from None
        where = f"key_file={key_file!r}"
    elif os.environ.get(KEY_ENV):
        value = os.environ[KEY_ENV].strip().encode()
        where = f"${KEY_ENV}"
    else:
        raise ConfigError(
            f"no cluster key: pass --key-file FILE or set ${KEY_ENV} "
            f"(at least {MIN_KEY_BYTES} bytes, e.g. `python -c 'import secrets; "
            "print(secrets.token_hex(32))'`)"
        )
    if len(value) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{where} holds a key of {len(value)} bytes; it must have at least {MIN_KEY_BYTES}"
        )
    return value


def curve_from_env() -> Any:
    """The CURVE key pair a node handed to this worker, or None (``$NEREUS_CURVE_SECRET``)."""
    secret = os.environ.get(CURVE_ENV)
    if not secret:
        return None
    from nereus.actors._curve import curve_from_secret

    return curve_from_secret(secret.encode(), f"${CURVE_ENV}")
