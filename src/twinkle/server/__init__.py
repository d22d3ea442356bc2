"""The training service: one base model, many tenants' LoRA adapters, over HTTP."""
