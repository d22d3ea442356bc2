"""What the Tinker protocol's requests do on a host: its protobuf bodies and its training computations."""
