"""KV cache: block hashing shared by both worlds, the prefix-cached block pool, router-side indexes."""
