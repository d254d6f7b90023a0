"""The CacheSeek HTTP service and the ``cacheseek`` command (shipped as ``cacheseek.server``)."""
