"""Hooks into host frameworks (Megatron-LM's training package)."""
