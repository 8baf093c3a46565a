"""kvfsm: KV-cache offloading whose lifecycles are declared in `spec/` and enforced by machines built from it."""
