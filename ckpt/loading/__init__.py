"""The load path: discovery, one resume over the tiers, the restore protocol, the shard
reader and verification."""
