"""What a checkpoint is on disk: names, the manifest and ``COMPLETE``, DCP's ``.metadata``,
checksums and the decoding of one saved tensor."""
