"""What a request must satisfy before it is queued, images included."""
