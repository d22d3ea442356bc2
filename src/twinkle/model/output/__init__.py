"""The output side of a model: the fused output layer and its per-token logprobs without whole logits, and a value
head.
"""
