"""slotserve's engine measured against the engines a user would pick instead, on the same
machine in the same run (`engine_speed`: transformers' generate() and continuous batching)."""
