"""The reference engine: prefix caching, preemption and async scheduling over a toy model whose tokens depend on
the KV bytes, so a wrong or late transfer shows in its output."""
