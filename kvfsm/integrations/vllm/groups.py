"""vLLM's KV-cache groups as kvfsm offloads them, the hybrid allocator on (`SupportsHMA`).

vLLM pages every group from one pool of GPU blocks: a block id is one group's at a time, and its bytes (one page per
layer of that group, every group the same size) are the same tensors' whichever group holds it. So a worker moves a
block the same way for any group; only the scheduler half tells groups apart. Each group is offloaded as a request of
its own inside kvfsm's one scheduler (the first full-attention group under the request's own id, every other group
under `<id>@g<group>`), with its own keys (`group_key`): one CPU pool, one ledger, one id space of jobs, and the GPU
fences of a block whichever group reads or writes it.

- Full attention (and MLA, a full-attention spec) keeps every block: a prefix is looked up, stored and reloaded
  whole, as without the hybrid allocator.
- A sliding-window group keeps only the blocks its window still reads, and vLLM's null block stands for the others:
  only the window at the end of a prompt is stored (`store_from`), a hit ends where every sliding group holds its
  whole window (`window_hit`), and only that window is reloaded. vLLM frees a running request's blocks as its
  window leaves them behind, and may hand them out in the same step; kvfsm follows the same arithmetic
  (`window_start`) and fires the request's `slide`, which leaves those its stores still read freed-while-read
  (`window-fence`).
- Any other kind (Mamba and other state-space or linear-attention state, chunked local attention, cross-attention)
  is refused at start-up by name: kvfsm cannot yet offload a state with its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from kvfsm.integrations.vllm.config import UnsupportedKVCache

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvfsm.connector.scheduler import RequestView


_FULL = (FullAttentionSpec, MLAAttentionSpec)
"""Kinds that keep every block (their subclasses with other rules, e.g. attention sinks, are refused)."""


@dataclass(frozen=True)
class Group:
    """One KV-cache group kvfsm offloads: vLLM's index of it, its place among kvfsm's, and its window (if any)."""

    index: int
    """vLLM's index of the group (`KVCacheBlocks.get_block_ids()[index]`)."""
    rank: int
    """Its place among the offloaded groups: 0 is the first full-attention group, whose keys are vLLM's hashes."""
    window: int | None
    """The sliding window in tokens; None for full attention."""

    def request_id(self, req_id: str) -> str:
        """The id kvfsm's scheduler tracks this group of the request under."""
        return req_id if self.rank == 0 else f"{req_id}@g{self.index}"

    def first_kept(self, tokens: int, block_size: int) -> int:
        """The first block of a request with `tokens` computed that vLLM still holds for this group (its window's
        first; 0 for full attention): vLLM's sliding-window manager skips every token the window no longer reads."""
        return 0 if self.window is None else max(0, tokens - self.window + 1) // block_size


def offloaded_groups(kv_cache_config: "KVCacheConfig", block_size: int) -> tuple[Group, ...]:
    """The groups of vLLM's configuration, the first full-attention group first; refuses by name what kvfsm cannot
    serve (a state-space or other group, no full-attention group, groups of another block size or page)."""
    groups = kv_cache_config.kv_cache_groups
    kinds = ", ".join(f"{i}: {type(g.kv_cache_spec).__name__}" for i, g in enumerate(groups))
    windows: list[int | None] = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):  # the trailing tokens vLLM retains beyond the window are kept too
            windows.append(spec.sliding_window + spec.extra_retained_tokens)
        elif type(spec) in _FULL:
            windows.append(None)
        else:
            raise UnsupportedKVCache(
                f"kvfsm offloads full-attention (and MLA) and sliding-window KV-cache groups; group {i} is a "
                f"{type(spec).__name__} ({kinds}): a state-space (Mamba) or other state is not offloaded with its "
                "prefix yet. Serve this model without kvfsm, or with vLLM's own OffloadingConnector")
        if spec.block_size != block_size:
            raise UnsupportedKVCache(f"KV-cache group {i} ({type(spec).__name__}) pages {spec.block_size} tokens a "
                                     f"block, the engine hashes {block_size}: kvfsm needs one block size ({kinds})")
    if None not in windows:
        raise UnsupportedKVCache(f"kvfsm needs a full-attention KV-cache group to look a prefix up by; this "
                                 f"configuration has none ({kinds})")
    sizes = {g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups}
    if len(sizes) != 1:
        raise UnsupportedKVCache(f"KV-cache groups of different bytes per block ({sorted(sizes)}; {kinds}): kvfsm's "
                                 "CPU pool has one block size")
    order = sorted(range(len(groups)), key=lambda i: (windows[i] is not None, i))
    return tuple(Group(index, rank, windows[index]) for rank, index in enumerate(order))


def group_key(block_hash: int, group: Group, width: int) -> int:
    """The key of `group`'s block with this hash: vLLM's hash for the first group, then the group's rank above the
    hash's `width` bytes, so no two groups' keys meet and a key tells its group (`is_first_group_key`)."""
    return block_hash | (group.rank << (8 * width)) if group.rank else block_hash


def is_first_group_key(key: int, width: int) -> bool:
    """Whether a key is vLLM's own hash (the first group's): only those are published as vLLM's KV-cache events."""
    return key >> (8 * width) == 0


class GroupView:
    """A request as kvfsm's scheduler tracks one group of it: its keys are the group's (`group_key`)."""

    def __init__(self, view: "RequestView", group: Group, codec: Any) -> None:
        """`codec`: the engine's `HashCodec`, whose width (learned from vLLM's first hash) places the group's rank."""
        self._view, self._group, self._codec = view, group, codec
        self._keys: list[int] = []
        self.request_id = group.request_id(view.request_id)

    @property
    def num_tokens(self) -> int:
        return self._view.num_tokens

    @property
    def block_hashes(self) -> Sequence[int]:
        hashes = self._view.block_hashes
        if len(self._keys) < len(hashes):
            width = self._codec.width or 0
            self._keys.extend(group_key(h, self._group, width) for h in hashes[len(self._keys):])
        return self._keys
