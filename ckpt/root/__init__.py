"""What is under a root, on which saving and loading both rest: the catalog of its
checkpoints, retention, quarantine, what this library may delete, the root's owner lease
and the root's usability check."""
