"""What proves kvfsm right: the world the invariants read, the trace and data oracles, mutants, the explorer."""
