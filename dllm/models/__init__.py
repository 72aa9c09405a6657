"""dllm/models."""
