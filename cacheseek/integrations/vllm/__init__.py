"""vLLM KV connector: a vLLM engine loads stored prefixes from CacheSeek into its pages
and stores the prompts it computes (docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CacheSeekConnector",
        "kv_connector_module_path": "cacheseek.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"codec": "int4", "model_id": "my-model"}}'

``CacheSeekConnector`` imports vLLM, so it is imported on first access; the rest of the
package (settings, page views, the scheduler and worker logic) needs torch only.
"""

from __future__ import annotations

from typing import Any

from .config import ConnectorConfig


def __getattr__(name: str) -> Any:
    if name in ("CacheSeekConnector", "CacheSeekMetadata", "CacheSeekStats"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CacheSeekConnector", "ConnectorConfig"]
