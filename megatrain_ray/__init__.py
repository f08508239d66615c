"""megatrain_ray: memory-centric LLM training as a pipeline of Ray actors on one node."""

__version__ = "0.1.0"
