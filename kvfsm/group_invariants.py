"""The spec's named invariants about an engine request's KV-cache groups tracked as requests of their own: a state
(a state-space group's blocks, each the state after its last token) is restored only with its prefix, at its end.

They read the same `World` as `kvfsm.invariants` (the requests' records); they live apart because only an engine with
several KV-cache groups (vLLM's hybrid allocator) tracks a request's groups beside each other.
"""

from __future__ import annotations

from kvfsm.invariants import World
from kvfsm.registry import REGISTRY


@REGISTRY.invariant("state-at-prefix-end")
def state_at_prefix_end(world: World) -> list[str]:
    """Each state request's last allocation restored exactly the one block ending where its prefix's load (in the
    same step) ended, or nothing when its prefix loaded nothing."""
    found = []
    for state in world.requests.values():
        prefix = world.requests.get(state.state_of) if state.state_of is not None else None
        if prefix is None:
            continue
        step, first, end = state.restored
        prefix_step, prefix_first, prefix_end = prefix.restored
        if step != prefix_step:
            found.append(f"state {state.req_id} was allocated at step {step}, its prefix {prefix.req_id} at step "
                         f"{prefix_step}: a state is restored only with its prefix")
        elif prefix_end > prefix_first and (first, end) != (prefix_end - 1, prefix_end):
            found.append(f"{prefix.req_id} loaded GPU blocks [{prefix_first}, {prefix_end}) but its state "
                         f"{state.req_id} restored [{first}, {end}): the engine would continue from a state that is "
                         f"not the one at the prefix's end")
        elif prefix_end == prefix_first and end > first:
            found.append(f"state {state.req_id} restored GPU blocks [{first}, {end}) while its prefix "
                         f"{prefix.req_id} loaded nothing")
    return found
