"""jaxtrain: train sharded Flax transformers on JAX, from one CPU to many GPU nodes."""

__version__ = "0.1.0"
