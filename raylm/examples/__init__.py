"""Example tasks the project makes itself, for demos, notebooks and benchmarks."""
