"""How a Mooncake client connects, and the bounds it keeps on its calls (`kvfsm.mooncake.client.MooncakeClient`).

A tier's config (`kvfsm.config.MooncakeTierConfig`) and the vLLM scheduler's master lookup build these; pydantic
refuses an unknown field or a bound that is not positive when they are built, before any connection is tried.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveFloat, PositiveInt

from kvfsm.mooncake.local import LOOPBACK, MasterAddress


class ClientSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    master: MasterAddress
    local_hostname: str = LOOPBACK
    """The address other Mooncake clients reach this one at (loopback for one host)."""
    segment_bytes: NonNegativeInt = 0
    """Memory this client lends to the store. 0: objects live on segment hosts and survive this engine."""
    transfer_buffer_bytes: PositiveInt = 16 << 20
    """Mooncake's `local_buffer_size`, used only by its copying calls (the zero-copy path registers the pool)."""
    op_timeout_s: PositiveFloat = 2.0
    """A call still queued this long after its submission is cancelled."""
    connect_timeout_s: PositiveFloat = 10.0
    max_pending: PositiveInt = 32
    retry_after_s: PositiveFloat = 1.0
    """After the store was found unreachable or slow, new calls are refused at once for this long."""
    hash_threads: PositiveInt | None = None
    """Threads that seal and check values' MACs, beside the I/O thread that moves the bytes. None: half the cores
    this process may run on, 2 to 8 (`kvfsm.mooncake.pipeline.default_hash_threads`)."""
    pipeline_bytes: PositiveInt = 8 << 20
    """The least one get of a fetch carries (unless less is left), beside one value per MAC thread: a fetch moves
    in several calls so that the checks overlap the transfers (`kvfsm.mooncake.pipeline`)."""
    get_lead_s: PositiveFloat = 0.008
    """How long before a fetch's get should end the next one is issued, on a second thread, so that its master
    round trip overlaps that transfer (`kvfsm.mooncake.paced_gets`). On a one-H200 host, fetches of 128 values of
    2 MiB read best between 3 and 8 ms into local memory and at 8 ms over TCP (docs/mooncake.md, session 28)."""
