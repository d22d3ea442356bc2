"""The hosts a model group runs its model on: this process, a Ray actor, worker processes, ranks over Ray."""
