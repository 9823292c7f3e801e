"""Attention kernels for jaxtrain. For now the XLA reference; the flash kernels (Pallas, Triton) join it here."""

from kernels.reference import mha_reference

__all__ = ["mha_reference"]
