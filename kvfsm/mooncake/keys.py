"""Object keys in a shared store: what a key must name so that no engine ever reads KV that is not its own.

A block's prefix hash says which tokens its KV covers, not which model computed it, in what dtype or layout, for
which tensor-parallel shard, or for which tenant. Engines of different models (or of one model sharded two ways)
share one Mooncake master, so the key binds all of them: `KvNamespace` names the producer, the optional per-request
salt (vLLM's `cache_salt`) names the tenant, and the block's prefix hash names the tokens. They are hashed together
with BLAKE2b (collision-resistant, unlike the engine's 64-bit prefix hash), so two keys are equal only if every
part is. Each part is length-prefixed before hashing, so no two different tuples serialise to the same bytes.

Two kinds of key: `object_key` names a rank's whole CPU block (its heads' share), so it binds the TP rank and world
size; `head_key` names one KV head's share of a block (`kvfsm.mooncake.heads`), bytes that do not depend on how the
heads are split among ranks, so it binds the head's index instead and no TP rank or size: engines of every TP size
of one model share those values. The `layout` of a namespace used with `head_key` must itself not depend on the TP
size (the tier names the layout per head). The two kinds never collide: their part tuples differ in length, and
length framing decodes uniquely.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

KEY_PREFIX = "kvfsm4"
"""Version of the store keys: a change of their scheme or of the stored value's format (`kvfsm.mooncake.value`)
bumps it, so that a value of another format is never found under a key this kvfsm names (a write-back finding one
would count the key as planted, never write it, and leave it a miss). 4: values sealed with keyed BLAKE3."""
NAMESPACE_PREFIX = "kvfsm2"
"""Version of namespace names (a shared disk tier's directory): bumped only when a directory's files change."""
DIGEST_BYTES = 20


class KvNamespace(BaseModel):
    """Everything about the producer that changes the bytes of a block's KV."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str = Field(min_length=1)
    """The model and its revision, e.g. `meta-llama/Llama-3.1-8B@<commit>`: weights decide the KV."""
    dtype: str = Field(min_length=1)
    """Element type of the KV cache (`bfloat16`, `float8_e4m3fn`, ...)."""
    layout: str = Field(min_length=1)
    """How a block's bytes are arranged (kvfsm's layout name plus anything that changes the arrangement)."""
    block_tokens: PositiveInt
    """Tokens one stored block covers (a CPU block: GPU block size × block size factor)."""
    tp_rank: NonNegativeInt = 0
    tp_world_size: PositiveInt = 1

    @model_validator(mode="after")
    def _rank_inside_world(self) -> KvNamespace:
        if self.tp_rank >= self.tp_world_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside a world of {self.tp_world_size}")
        return self

    def _shared_fields(self) -> tuple[str, ...]:
        """What every TP size of one model agrees on."""
        return (self.model_id, self.dtype, self.layout, str(self.block_tokens))

    def _fields(self) -> tuple[str, ...]:
        return self._shared_fields() + (str(self.tp_rank), str(self.tp_world_size))


def _framed(parts: tuple[str, ...]) -> bytes:
    out = bytearray()
    for part in parts:
        raw = part.encode()
        out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def object_key(namespace: KvNamespace, block_hash: int, salt: str | None = None) -> str:
    """The store key of one block: `kvfsm4-<hex digest>`, a BLAKE2b over namespace, salt and prefix hash.

    An empty salt is no salt, as in vLLM, where only a non-empty `cache_salt` enters the prefix hash.
    """
    return _key(namespace._fields() + (salt or "", str(block_hash)))


def head_key(namespace: KvNamespace, block_hash: int, head: int, salt: str | None = None) -> str:
    """The store key of KV head `head`'s share of one block (its global index among the model's KV heads): a
    BLAKE2b over the namespace without its TP rank and world size, the salt, the head and the prefix hash."""
    return _key(namespace._shared_fields() + (salt or "", f"head:{head}", str(block_hash)))


def _key(parts: tuple[str, ...]) -> str:
    digest = hashlib.blake2b(_framed(parts), digest_size=DIGEST_BYTES, person=b"kvfsm-block-key").hexdigest()
    return f"{KEY_PREFIX}-{digest}"


def namespace_name(namespace: KvNamespace) -> str:
    """`kvfsm2-<hex digest>` of the namespace alone: names what one producer stores, such as a shared disk tier's
    directory, where each block's own name is its prefix hash."""
    digest = hashlib.blake2b(_framed(namespace._fields()), digest_size=DIGEST_BYTES,
                             person=b"kvfsm-namespace").hexdigest()
    return f"{NAMESPACE_PREFIX}-{digest}"
