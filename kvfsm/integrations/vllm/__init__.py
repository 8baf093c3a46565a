"""kvfsm as a vLLM 0.32 KV connector.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KvfsmConnector", "kv_connector_module_path": "kvfsm.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": 42949672960}}'

`kv_connector_extra_config` is validated as `kvfsm.config.OffloadConfig` when vLLM starts.
"""

from kvfsm.integrations.vllm.config import InvalidExtraConfig, UnsupportedKVCache, UnsupportedTier
from kvfsm.integrations.vllm.connector import KvfsmConnector, WrongRole

__all__ = ["InvalidExtraConfig", "KvfsmConnector", "UnsupportedKVCache", "UnsupportedTier", "WrongRole"]
