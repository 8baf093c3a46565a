"""The tenant's secret: where the operator puts it, how a value key is derived from it, and how it stays hidden.

A shared store is written by every client of its master, so a value's bytes are trusted only if they carry a MAC
that only holders of the tenant's secret can make (`kvfsm.mooncake.value`). The operator provides the secret, at
least `MIN_SECRET_BYTES` bytes, in a file (`MooncakeTierConfig.secret_file`) or an environment variable
(`secret_env`, `KVFSM_MOONCAKE_SECRET` unless configured otherwise); it is read once, when the tier opens, and a
missing, unreadable or short secret is `SecretUnavailable` there, before anything is written or fetched.

The secret never leaves this module: what the client holds is a `ValueKey` derived from it (BLAKE3's key-derivation
mode, from the `blake3` package, bound to the tenant name, so one secret handed to two tenants by mistake still gives
two keys), whose repr and str say nothing of it, and no message here names more than where the secret was looked for and
how long it was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blake3 import blake3

KEY_BYTES = 32
"""Keyed BLAKE3's key length: the MAC's key (`kvfsm.mooncake.value`)."""
MIN_SECRET_BYTES = KEY_BYTES
"""256 bits: a secret shorter than the MAC's key adds no strength and is refused."""
DEFAULT_SECRET_ENV = "KVFSM_MOONCAKE_SECRET"
_CONTEXT = "kvfsm 2026-11-28 mooncake value MAC key v4"
"""BLAKE3's key-derivation context (fixed, unique to this use): a key derived here is never the key of any other use
of the same secret. The `blake3` package is imported only when a key is made or used: it comes with the `mooncake`
extra, and kvfsm without that extra (the demo, an engine with no Mooncake tier) imports this module through the
tiers and the testing controls."""


class SecretUnavailable(ValueError):
    """The tenant's secret could not be read, or is too short: the Mooncake tier does not open."""


class ValueKey:
    """The 32-byte MAC key of one tenant's values; hides its bytes from repr, str and pickling."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a value key is {KEY_BYTES} bytes")
        self._key = key

    @classmethod
    def derive(cls, secret: bytes, tenant: str | None) -> ValueKey:
        """The key of `tenant`'s values: BLAKE3 in its key-derivation mode over the tenant's name (length first, so
        no name and secret run together into another pair's bytes) and the secret."""
        from blake3 import blake3

        name = (tenant or "").encode()
        material = len(name).to_bytes(4, "little") + name + secret
        return cls(blake3(material, derive_key_context=_CONTEXT).digest(KEY_BYTES))

    def hasher(self) -> blake3:
        """A fresh keyed BLAKE3 under this key (`kvfsm.mooncake.value` takes its MAC tags from it): one per tag, so
        that the MAC threads share nothing."""
        from blake3 import blake3

        return blake3(key=self._key)

    def __repr__(self) -> str:
        return "ValueKey(<hidden>)"

    __str__ = __repr__

    def __reduce__(self) -> object:
        raise TypeError("a value key is never pickled: each process reads the secret itself")


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes().strip()
    except OSError as error:
        raise SecretUnavailable(f"the Mooncake secret file {path} cannot be read: {error.strerror}") from None


def load_value_key(secret_file: Path | None, secret_env: str, tenant: str | None) -> ValueKey:
    """The tenant's value key, from `secret_file` if given, else from the environment variable `secret_env`."""
    if secret_file is not None:
        secret, where = _read_file(secret_file), f"the file {secret_file}"
    else:
        found = os.environ.get(secret_env)
        if found is None:
            raise SecretUnavailable(f"the environment variable {secret_env} that should hold the Mooncake secret is "
                                    "not set (or configure secret_file)")
        secret, where = found.strip().encode(), f"the environment variable {secret_env}"
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretUnavailable(f"the Mooncake secret in {where} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} "
                                "are needed (e.g. `openssl rand -hex 32`)")
    return ValueKey.derive(secret, tenant)
