"""Who runs next on a model's worker: the fair scheduler, and Tinker's seq_id order."""
