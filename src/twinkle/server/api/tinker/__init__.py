"""The Tinker wire protocol, spoken by twinkle's server so the unmodified ``tinker`` SDK trains against it."""
