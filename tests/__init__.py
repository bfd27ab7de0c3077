"""ascendspeed's test suite: a regular package, so that no other top-level ``tests`` (Megatron-LM's) shadows it."""
