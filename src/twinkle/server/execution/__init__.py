"""What runs the hosted models: the hosts (in this process, in a Ray actor, on several ranks), the
model groups and sampler groups around them, the schedulers that feed them, and the checks a
request passes before it is queued. Nothing here knows HTTP."""
