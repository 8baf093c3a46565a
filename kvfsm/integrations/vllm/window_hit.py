"""The hit a request with sliding-window groups is offered under vLLM's hybrid allocator (`longest-window-hit`).

A sliding group's CPU blocks are only ever windows: the window at a prompt's end, then what a running request
completes. So the CPU pool often holds a full-attention prefix further than any window: a longer prompt's store
leaves its window at its own end, and a request that shares only part of that prompt finds the full group's prefix
but no window ending where it does. The rule, `longest-window-hit`, has two halves:

- whole: the hit ends at a block E at which every sliding group holds its whole window (its blocks
  `[first_kept(E), E)`, those below the request's GPU prefix excepted: vLLM computed them). A hit past a partial
  window would let vLLM compute on window blocks nobody loaded. A bounded-replay window, which vLLM keeps none of on
  its GPU, is loaded from its first block even below the GPU prefix's end when the CPU pool holds those blocks
  (`load_start`), so vLLM is told it restored (`loaded-groups`) and recomputes none of it. A full-attention group
  after the first (vLLM makes several when full-attention layers outnumber the others) is a window whose first kept
  block is 0: it holds the same prefix's blocks under its own keys, its layers' bytes, so it needs every block of the
  hit.
- longest: E is the largest such end up to where the full-attention group's hit ends. When the window is missing
  there, a shorter hit whose windows are whole is offered (an earlier prompt's window, or a running request's
  stored blocks), as vLLM's `OffloadingConnector` searches one; no hit only when no such end lies past the GPU prefix.

Each group is looked up through kvfsm's scheduler (`get_num_new_matched_tokens`) at the window ending at the full
hit's end first, so a busy block or a lower tier's copy defers the request exactly as a whole hit would; only a plain
miss there starts the search for a shorter end (`longest_end`), which reads the CPU pool's catalogue without
changing any state, and then each group is looked up again at the window ending where it stopped.

Bound: the search walks down from the full hit's end and reads each block between the GPU prefix and that end at
most once per sliding group (a group's blocks known held are never read again; with CPU blocks of several GPU
blocks, one key more per read), and each step down costs one comparison per group: O(groups × blocks) a lookup,
never a window's length per candidate end. Its controls: `kvfsm.testing.window_mutants`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvfsm.integrations.vllm.groups import Group, GroupView

if TYPE_CHECKING:
    from kvfsm.connector.scheduler import SchedulerConnector
    from kvfsm.integrations.vllm.convert import RequestView


class WindowHits:
    """`longest-window-hit` for one scheduler side: its groups after the first (`Group.first_kept` gives each one's
    window), looked up in its kvfsm scheduler."""

    def __init__(self, kvfsm: "SchedulerConnector", windows: Sequence[Group]) -> None:
        self.kvfsm, self.windows = kvfsm, tuple(windows)
        self.block_size = kvfsm.config.gpu_block_size

    def match(self, view: "RequestView", views: Sequence[GroupView], computed: int,
              match: tuple[int, bool]) -> tuple[int, bool] | None:
        """The full-attention group's hit (`match`, already looked up) cut to the longest end at which every sliding
        group holds its whole window, each window looked up as its own request's hit; None defers (a window block is
        busy, or a lower tier's copy is being fetched). `views`: the request's view of each window group, in order."""
        first, end = computed // self.block_size, (computed + match[0]) // self.block_size
        whole = self._look_up(views, first, end)
        if whole is None:
            return None
        if not whole:
            end = self.longest_end(views, first, end)
            for group_view in views:  # counted once: each window is looked up again where the shorter hit ends
                self.kvfsm.limit_match(group_view.request_id, 0)
            if self._look_up(views, first, end) is None:
                return None
        partners = [group_view.request_id for group_view in views]  # the prefix and its groups offered together
        if not self.kvfsm.match_together(view.request_id, partners, end):  # (`state-at-prefix-end`) or not at all
            return 0, False
        return match if whole else ((end - first) * self.block_size, match[1] and end > first)

    def window_start(self, group: Group, first: int, end: int) -> int:
        """The first block a hit ending at block `end` must load for `group`: its window's, or the GPU prefix's end."""
        return max(first, group.first_kept(end * self.block_size, self.block_size))

    def load_start(self, view: GroupView, group: Group, first: int, end: int) -> int:
        """The first block `group`'s lookup asks for at a hit ending at block `end` past the GPU prefix's (`first`): its
        `window_start`, except that a group vLLM keeps no GPU prefix of (a bounded-replay window, `Group.gpu_cached`)
        starts at its window's first block when the CPU pool holds ready each of the window's blocks below the GPU
        prefix's end (none, for a window that begins above it). vLLM gives such a group fresh blocks for its whole
        window, so the load writing all of it restores the group and vLLM recomputes none of it (`loaded-groups`);
        when those blocks are not all held, the hit is the one the window's blocks above the GPU prefix's end make,
        and vLLM recomputes the window. With no hit past the GPU prefix nothing is looked up below it either."""
        kept = group.first_kept(end * self.block_size, self.block_size)
        if group.gpu_cached or end <= first or self._first_lacking(view, kept, first) < first:
            return self.window_start(group, first, end)
        return kept

    def longest_end(self, views: Sequence[GroupView], first: int, end: int) -> int:
        """The largest block E in [first, end] at which every group holds its window `[window_start, E)` in CPU;
        `first` when none does. A block m a group lacks inside the candidate's window rules out every end from m + 1
        to the candidate (a shorter end's window starts no later), so the next candidate is the lowest block any group
        lacks; `held[i]` is where group i's run known held (up to the candidate) starts, so no block is read twice."""
        held = [end] * len(views)
        candidate = end
        while candidate > first:
            shorter = candidate
            for i, (view, group) in enumerate(zip(views, self.windows)):
                start, top = self.window_start(group, first, candidate), min(held[i], candidate)
                if start < top:
                    lacking = self._first_lacking(view, start, top)
                    held[i] = start
                    if lacking < top:
                        shorter = min(shorter, lacking)
            if shorter == candidate:
                return candidate
            candidate = shorter
        return first

    def _first_lacking(self, view: GroupView, start: int, stop: int) -> int:
        """The first GPU block in [start, stop) whose CPU block the pool does not hold ready (`stop` if none): one
        catalogue read per CPU block up to the first it lacks, no state changed."""
        k = self.kvfsm.config.block_size_factor
        first_cpu = start // k
        keys = view.block_hashes[first_cpu * k + k - 1:-(-stop // k) * k:k]  # a CPU block's key: its last GPU block's
        hits = self.kvfsm.manager.lookup(keys, every_busy=False).hits
        return min(stop, max(start, (first_cpu + hits) * k))

    def _look_up(self, views: Sequence[GroupView], first: int, end: int) -> bool | None:
        """Each group's window ending at block `end` looked up as its request's hit: whether every window is whole;
        None when a lookup deferred. `match` cuts every group's offer at the end it settles on (`match_together`)."""
        whole = True
        for view, group in zip(views, self.windows):
            start = self.load_start(view, group, first, end)
            found = self.kvfsm.get_num_new_matched_tokens(view, start * self.block_size)
            if found is None:
                return None
            whole = whole and start + found[0] // self.block_size >= end
        return whole
