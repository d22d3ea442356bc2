"""Sampling on a host: chat completions, sampling in slices and in one batch, passes on a sampler group, vLLM."""
