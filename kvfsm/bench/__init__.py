"""Benchmarks of kvfsm components."""
