"""Per-row LoRA layers: each row of a batch through its own adapter, on linear layers and on fused expert stacks."""
