"""Host memory that every rank process of one host maps: the one host copy of replicated (MLA) KV.

With replicated KV every rank's pool would hold the same bytes, so the ranks of a host share one region instead
(`OffloadConfig.replicated`). The region is a file in `/dev/shm` mapped shared by each process (`torch.from_file`
with `shared=True`): the first rank creates it at exactly the pool's size and sends its path to the others, who
attach to it before registering their caches; each process then registers its own mapping
(`Device.register_host`: page-locked and portable on CUDA, so every rank's copy engine reaches it). The mapping is
page-aligned (mmap), which CUDA host registration needs. A registration is the process's, not a device's: CUDA
refuses a second one of a range still registered, so each distinct mapping is registered once, by the first rank
that allocates it, and released by that rank's device once no rank of the process uses it. The creating process
removes the path once it released its last mapping (or on `close`, where registration failed); the others attached
at registration, and their mappings stay valid until they release theirs, so the order in which ranks shut down
does not matter. Where every rank is in one
process (`named=False`: the reference engine's `LocalRanks`) the region is an anonymous mapping that each rank's
pool maps as is, and no file is made (an explorer making thousands of engines leaves none behind).

Beside the region the ranks share a small table (`table`: one int64 per slot, zero when made), where the replicated
pool's block checksums live: the rank that copied a block takes its checksum there and every rank checks its load
against it (`kvfsm.connector.checksums`). It is a second file (the region's path plus `.sums`), made by the creator
when it first asks for it (on registration, before it sends the path) and removed with the region.

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
TABLE_SUFFIX = ".sums"


class SharedRegionMismatch(ValueError):
    """A rank attached to a shared region of another size than its pool (its ranks registered different caches), or
    an instance told to attach that names a region already."""


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
        self._registrations: dict[int, tuple[Device, int]] = {}
        """Each mapping handed out and not released yet, by data pointer: the device that registered it, and how
        many of the ranks' pools use it (the anonymous mapping is one for every rank; a named one is mapped anew
        each time)."""
        self._table: torch.Tensor | None = None
        """Without `named`: the one anonymous table every rank of this process uses."""

    def allocate(self, device: Device, nbytes: int) -> torch.Tensor:
        """A mapping of the region, `nbytes` long, registered for every device of this process (by `device`, unless
        another rank's pool registered this mapping already); the region is created at that size if this instance
        names none yet."""
        if nbytes <= 0:
            raise ValueError(f"a host allocation needs a positive size, got {nbytes}")
        buffer = self._named(nbytes) if self.named else self._anonymous(nbytes)
        registrar, users = self._registrations.get(buffer.data_ptr(), (device, 0))
        if not users:
            device.register_host(buffer)  # portable: every device of this process reaches it
        self._registrations[buffer.data_ptr()] = (registrar, users + 1)
        return buffer

    def attach(self, path: str) -> None:
        """Name the region another process created, before this instance's first `allocate`: where the instance must
        exist before the creator has registered and sent its path (a vLLM worker's connector half is built first)."""
        if not self.named or self.path is not None:
            raise SharedRegionMismatch(f"attach to {path}: this instance names {self.path or 'an anonymous region'}")
        self.path = path

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

    def table(self, entries: int) -> torch.Tensor:
        """`entries` int64 values the ranks share beside the region (zero when made): made by the creator (or in
        this process without `named`), attached to by the others. Call after `allocate`."""
        nbytes = entries * 8
        if not self.named:
            if self._table is None:
                self._table = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.int64)
            return self._table
        if self.path is None:
            raise SharedRegionMismatch("the shared region's table is asked for before the region exists")
        path = self.path + TABLE_SUFFIX
        if self._created and not os.path.exists(path):
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(descriptor, nbytes)
            finally:
                os.close(descriptor)
        if os.path.getsize(path) != nbytes:
            raise SharedRegionMismatch(f"shared table {path} holds {os.path.getsize(path)} bytes; this rank's pool "
                                       f"needs {nbytes}")
        return torch.from_file(path, shared=True, size=entries, dtype=torch.int64)

    def release(self, buffer: torch.Tensor) -> None:
        """One rank's pool is done with its mapping: the mapping is unregistered (by the device that registered it)
        once no pool uses it, and unmapped once the last tensor on it is gone; the creator's last release removes
        the path."""
        registrar, users = self._registrations.pop(buffer.data_ptr())
        if users > 1:
            self._registrations[buffer.data_ptr()] = (registrar, users - 1)
        else:
            registrar.unregister_host(buffer)
        if not self._registrations:
            self.close()

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the region occupies, whichever number of ranks map it (0 before it exists)."""
        if not self.named:
            return self._local.numel() if self._local is not None else 0
        return os.path.getsize(self.path) if self.path is not None and os.path.exists(self.path) else 0

    def close(self) -> None:
        """Remove the region's path if this process created it (mappings still open stay valid); twice is harmless."""
        if self._created and self.path is not None:
            for path in (self.path, self.path + TABLE_SUFFIX):
                if os.path.exists(path):
                    os.unlink(path)
        self._created = False
