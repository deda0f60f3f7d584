"""What a run's objects become in a checkpoint and back: the application state, what a
manager captures, per-rank values and RNG, and the save-time check that it loads back."""
