"""What stays and what goes under a root: retention, quarantine, what this library may
delete, the root's owner lease and the root's usability check."""
