"""KV cache manager: paged blocks with a tier each, budgets per tier, a pinned host arena."""

from directkv.memory.arena import HostArena
from directkv.memory.kv_cache import KVCacheManager, KVStats

__all__ = ["HostArena", "KVCacheManager", "KVStats"]
