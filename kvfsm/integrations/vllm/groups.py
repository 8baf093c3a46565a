"""vLLM's KV-cache groups as kvfsm offloads them, the hybrid allocator on (`SupportsHMA`).

vLLM pages every group from one pool of GPU blocks: a block id is one group's at a time, and its bytes (one page per
layer of that group, every group the same size) are the same tensors' whichever group holds it. So a worker moves a
block the same way for any group; only the scheduler half tells groups apart. Each group is offloaded as a request of
its own inside kvfsm's one scheduler (the first full-attention group under the request's own id, every other group
under `<id>@g<group>`, `kvfsm.connector.tracked_ids`), with its own keys (`group_key`): one CPU pool, one ledger, one
id space of jobs, and the GPU fences of a block whichever group reads or writes it.

- Full attention (and MLA, a full-attention spec) keeps every block: a prefix is looked up, stored and reloaded
  whole, as without the hybrid allocator.
- A sliding-window group keeps only the blocks its window still reads, and vLLM's null block stands for the others:
  only the window at the end of a prompt is stored (`store_from`), a hit ends where every sliding group holds its
  whole window (`window_hit`), and only that window is reloaded. vLLM frees a running request's blocks as its
  window leaves them behind, and may hand them out in the same step; kvfsm follows the same arithmetic
  (`window_start`) and fires the request's `slide`, which leaves those its stores still read freed-while-read
  (`window-fence`). DeepSeek-V4.1's bounded-replay window (a `SlidingWindowMLASpec`) is served the same way, but vLLM
  keeps none of its blocks in its GPU prefix cache (`Group.gpu_cached`) and recomputes a hit's last window unless the
  connector says its load restored the group (`SchedulerSide.get_loaded_kv_cache_group_ids`).
- A state-space group (vLLM's `MambaSpec`) in vLLM's "align" cache mode keeps, per block, the state after the block's
  last token (vLLM ends every prefill chunk at a block's end, and keeps only the state it runs on and the one before): a
  sliding window of one block in kvfsm's terms. States are stored from a prompt's last whole block on (`store_from`:
  none of the prompt's earlier chunks, then each decoded block's as it completes), a hit needs exactly the state ending
  where the full-attention hit ends and restores that one block with the prefix (`state-at-prefix-end`), and the blocks
  vLLM takes back behind the running state are told to kvfsm as a window's are (`slide`). Any other cache mode keeps no
  state at a block's end ("none": prefix caching off), a state block whose table moves (speculative blocks) or a CPU
  block of several GPU blocks (`block_size_factor`) would hold states vLLM never kept: refused by name.
- A chunked local attention group (vLLM's `ChunkedLocalAttentionSpec`) reads only the tokens of its own chunk
  (`attention_chunk_size` tokens, chunks laid end to end from the first token): a window whose first kept block for a
  request with E tokens computed is the first of E's chunk, as vLLM's chunked-local manager frees every block of the
  chunks before. It is served as a sliding window is (`store_from`, `window_hit`, `slide`, `window-fence`) with that
  `first_kept`; a hit ending at a chunk's boundary needs none of its blocks. A chunk that is not a whole number of
  blocks (a block split between two chunks, its first kept while the second's tokens are read) is refused by name:
  kvfsm's scenarios prove the arithmetic on whole-block chunks only.
- Several full-attention groups (vLLM makes them when full-attention layers outnumber the others): each holds the same
  prefix's blocks for its own layers, so each after the first is stored and reloaded whole under its own keys, and a
  hit needs every block of it (`window_hit`, a window that keeps every block).
- Any other kind (cross-attention, attention sinks) is refused at start-up by name, and so are block hashes finer than
  a block (vLLM's `prefix_match_unit` below the block size): kvfsm keys a block by one hash, its whole prefix's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvfsm.connector.tracked_ids import tracked_id
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
    """The sliding window in tokens; None for full attention and for a state."""
    state: bool = False
    """A state-space group's: each block the state after its last token, only the running state's kept."""
    chunk: int | None = None
    """Chunked local attention's chunk in tokens (a whole number of blocks); None for any other kind."""
    gpu_cached: bool = True
    """vLLM's own GPU prefix cache holds this group's blocks (its spec's `prefix_cacheable`). False for a DeepSeek-V4.1
    bounded-replay window (`SlidingWindowMLASpec` with `bounded_replay`): vLLM keeps none of its blocks for a GPU
    prefix and gives it fresh blocks for its whole window, so a load restores it only if it writes that whole window,
    which kvfsm's lookup asks for when the CPU pool holds it (`WindowHits.load_start`, `loaded-groups`)."""

    @property
    def label(self) -> int | None:
        """The number its tracked ids carry (`tracked_id`): vLLM's index of the group; None for the first."""
        return None if self.rank == 0 else self.index

    def request_id(self, req_id: str) -> str:
        """The id kvfsm's scheduler tracks this group of the request under."""
        return tracked_id(req_id, self.label)

    def first_kept(self, tokens: int, block_size: int) -> int:
        """The first block of a request with `tokens` computed that vLLM still holds for this group (its window's
        first; 0 for full attention): vLLM's sliding-window manager skips every token the window no longer reads, its
        Mamba manager every token before the last (whose block holds the state the request runs on), its chunked-local
        manager every chunk before the one the next token is in."""
        if self.state:
            return max(0, tokens - 1) // block_size
        if self.chunk is not None:
            return tokens // self.chunk * self.chunk // block_size
        return 0 if self.window is None else max(0, tokens - self.window + 1) // block_size


def offloaded_groups(kv_cache_config: "KVCacheConfig", block_size: int, block_size_factor: int = 1,
                     ) -> tuple[Group, ...]:
    """The groups of vLLM's configuration, the first full-attention group first; refuses by name what kvfsm cannot
    serve (block hashes finer than a block; a state group outside "align" mode, or under a `block_size_factor`; a
    chunk not a whole number of blocks; another kind; no full-attention group; groups of another block size or
    page)."""
    groups = kv_cache_config.kv_cache_groups
    kinds = ", ".join(f"{i}: {type(g.kv_cache_spec).__name__}" for i, g in enumerate(groups))
    hashed = kv_cache_config.hash_block_size
    if hashed is not None and hashed < block_size:
        raise UnsupportedKVCache(
            f"vLLM hashes every {hashed} tokens (prefix_match_unit) and pages {block_size} tokens a block ({kinds}): "
            "kvfsm keys a block by one hash, the hash of the prefix up to its end; unset prefix_match_unit or set it "
            f"to {block_size}")
    windows: list[int | None] = []
    states: list[bool] = []
    chunks: list[int | None] = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        states.append(isinstance(spec, MambaSpec))
        chunks.append(spec.attention_chunk_size if isinstance(spec, ChunkedLocalAttentionSpec) else None)
        if isinstance(spec, SlidingWindowSpec):  # the trailing tokens vLLM retains beyond the window are kept too
            windows.append(spec.sliding_window + spec.extra_retained_tokens)
        elif type(spec) in _FULL or isinstance(spec, (MambaSpec, ChunkedLocalAttentionSpec)):
            if isinstance(spec, MambaSpec):
                _check_state(i, spec, block_size_factor, kinds)
            if isinstance(spec, ChunkedLocalAttentionSpec) and spec.attention_chunk_size % spec.block_size:
                raise UnsupportedKVCache(
                    f"KV-cache group {i} is a ChunkedLocalAttentionSpec of {spec.attention_chunk_size}-token chunks "
                    f"in {spec.block_size}-token blocks ({kinds}): kvfsm offloads chunks of whole blocks only; use "
                    "a block size that divides the chunk")
            windows.append(None)
        else:
            raise UnsupportedKVCache(
                f"kvfsm offloads full-attention (and MLA), sliding-window, chunked local attention and state-space "
                f"(Mamba, align mode) KV-cache groups; group {i} is a {type(spec).__name__} ({kinds}). Serve this "
                "model without kvfsm, or with vLLM's own OffloadingConnector")
        if spec.block_size != block_size:
            raise UnsupportedKVCache(f"KV-cache group {i} ({type(spec).__name__}) pages {spec.block_size} tokens a "
                                     f"block, the engine hashes {block_size}: kvfsm needs one block size ({kinds})")
    full = [i for i, group in enumerate(groups) if type(group.kv_cache_spec) in _FULL]
    if not full:
        raise UnsupportedKVCache(f"kvfsm needs a full-attention KV-cache group to look a prefix up by; this "
                                 f"configuration has none ({kinds})")
    sizes = {g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups}
    if len(sizes) != 1:
        raise UnsupportedKVCache(f"KV-cache groups of different bytes per block ({sorted(sizes)}; {kinds}): kvfsm's "
                                 "CPU pool has one block size")
    order = full + [i for i in range(len(groups)) if i not in full]
    return tuple(Group(index, rank, windows[index], states[index], chunks[index],
                       groups[index].kv_cache_spec.prefix_cacheable) for rank, index in enumerate(order))


def _check_state(index: int, spec: MambaSpec, block_size_factor: int, kinds: str) -> None:
    """A state group kvfsm can offload: vLLM keeps the state at every block's end, in place, one GPU block a CPU
    block."""
    if spec.mamba_cache_mode != "align":
        raise UnsupportedKVCache(
            f"KV-cache group {index} is a MambaSpec in mamba_cache_mode {spec.mamba_cache_mode!r} ({kinds}): kvfsm "
            "offloads a state only in 'align' mode (prefix caching on), where vLLM keeps the state at each block's end")
    if spec.num_speculative_blocks:
        raise UnsupportedKVCache(
            f"KV-cache group {index} is a MambaSpec with {spec.num_speculative_blocks} speculative blocks ({kinds}): "
            "vLLM moves those within the block table, so a block no longer holds the state at its own end")
    if block_size_factor != 1:
        raise UnsupportedKVCache(
            f"KV-cache group {index} is a MambaSpec ({kinds}) and block_size_factor is {block_size_factor}: a CPU "
            "block of several GPU blocks would hold states vLLM never kept (only the last block's is); use 1")


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
