"""The runtime: what a call holds between the user and a backend — the cache of built
BlockMasks (keys apart from the cache) and lazy handles."""
