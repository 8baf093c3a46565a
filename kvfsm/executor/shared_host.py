"""Host memory that every rank process of one host maps: the one host copy of replicated (MLA) KV.

With replicated KV every rank's pool would hold the same bytes, so the ranks of a host share one region instead
(`OffloadConfig.replicated`). The region is a file in `/dev/shm` mapped shared by each process (`torch.from_file`
with `shared=True`): the first rank creates it at exactly the pool's size and sends its path to the others, who
attach to it before registering their caches; each process then registers its own mapping with its device
(`Device.register_host`: page-locked on CUDA, so every rank's copy engine reaches it). The mapping is page-aligned
(mmap), which CUDA host registration needs. The creating process removes the path once it released its last
mapping (or on `close`, where registration failed); the others attached at registration, and their mappings stay
valid until they release theirs, so the order in which ranks shut down does not matter. Where every rank is in one
process (`named=False`: the reference engine's `LocalRanks`) the region is an anonymous mapping that each rank's
pool maps as is, and no file is made (an explorer making thousands of engines leaves none behind).

Threading: one worker half per process uses its region, from the engine's thread only.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path

import torch

from kvfsm.executor.device import Device

SHM_FOLDER = Path("/dev/shm")


class SharedRegionMismatch(ValueError):
    """A rank attached to a shared region of another size than its pool: its ranks registered different caches."""


class SharedRegionUnavailable(OSError):
    """`/dev/shm` cannot hold the pool (a container's default is 64 MiB): refused at registration, before a rank
    touches a page that is not there (which would kill it with SIGBUS mid-copy)."""


class SharedHostMemory:
    """The host memory of one pool shared by the ranks of a host: `allocate` creates the region on its first call
    (or attaches to `path`, which another process created) and maps it again on each later call, for another rank
    of this process. Use one instance per process; the creating process's `close` removes the path."""

    def __init__(self, path: str | None = None, named: bool = True) -> None:
        self.path: str | None = path
        """The region's file; None until this process creates it (and always without `named`)."""
        self.named = named
        self._created = False
        self._local: torch.Tensor | None = None
        """Without `named`: the one anonymous mapping every rank of this process uses."""
        self._mapped = 0
        """Mappings handed out and not released yet."""

    def allocate(self, device: Device, nbytes: int) -> torch.Tensor:
        """A mapping of the region, `nbytes` long, registered with `device`; the region is created at that size if
        this instance names none yet."""
        if nbytes <= 0:
            raise ValueError(f"a host allocation needs a positive size, got {nbytes}")
        buffer = self._named(nbytes) if self.named else self._anonymous(nbytes)
        device.register_host(buffer)
        self._mapped += 1
        return buffer

    def _anonymous(self, nbytes: int) -> torch.Tensor:
        if self._local is None:
            self._local = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
        if self._local.numel() != nbytes:
            raise SharedRegionMismatch(f"the shared region holds {self._local.numel()} bytes; this rank's pool needs "
                                       f"{nbytes}")
        return self._local

    def _named(self, nbytes: int) -> torch.Tensor:
        if self.path is None:
            path = SHM_FOLDER / f"kvfsm-{os.getpid()}-{uuid.uuid4().hex}"
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(descriptor, 0, nbytes)  # every page now, not a sparse file that may not fit
            except OSError as err:
                os.unlink(path)
                raise SharedRegionUnavailable(f"{SHM_FOLDER} cannot hold a shared pool of {nbytes} bytes: {err}") \
                    from err
            finally:
                os.close(descriptor)
            self.path, self._created = str(path), True
        size = os.path.getsize(self.path)
        if size != nbytes:
            raise SharedRegionMismatch(f"shared region {self.path} holds {size} bytes; this rank's pool needs {nbytes}")
        return torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)

    def release(self, device: Device, buffer: torch.Tensor) -> None:
        """Unregister one mapping from its device (it is unmapped once the last tensor on it is gone); the creator's
        last release removes the path."""
        self._mapped -= 1
        device.unregister_host(buffer)
        if self._mapped == 0:
            self.close()

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the region occupies, whichever number of ranks map it (0 before it exists)."""
        if not self.named:
            return self._local.numel() if self._local is not None else 0
        return os.path.getsize(self.path) if self.path is not None and os.path.exists(self.path) else 0

    def close(self) -> None:
        """Remove the region's path if this process created it (mappings still open stay valid); twice is harmless."""
        if self._created and self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)
        self._created = False
