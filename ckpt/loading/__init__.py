"""The load path: the restore protocol, the shard reader and verification (the root's
catalog is :mod:`ckpt.root.catalog`; the resume walk over the tiers, :mod:`ckpt.tiers.resume`)."""
