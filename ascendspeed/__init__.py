"""ascendspeed: an accelerator plugin for Megatron-LM.

Importing this package does nothing; ``import ascendspeed.megatron_adaptor`` switches it on.
"""
__version__ = "0.1.0"
