"""Checkpoint readers: ranges of stored tensors read from safetensors files and DCP directories
without collectives."""
