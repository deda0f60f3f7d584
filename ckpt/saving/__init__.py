"""The save path: the commit protocol, the shard writer, asynchronous saves, the
manager's durable saves, when a save is due, and the non-finite check on the bytes written."""
