"""The runtime: what a call holds between the user and a backend — the spec of a build
(validated once), the cache of built BlockMasks (keys apart from the cache) and lazy
handles."""
