"""Each adapter's optimizer side: optimizers and schedulers by name, clipping and stepping, several adapters in one
update, state offloaded while idle.
"""
