"""Adapters that plug kvfsm into inference engines.

Each adapter imports its engine, so nothing here is imported by `import kvfsm`: import the one you use
(`kvfsm.integrations.vllm`) and only then is that engine loaded.
"""
