"""Helpers shared by the tests; importing them has no side effects (the adaptor is installed by
``tests/conftest.py`` in the pytest process and by ``distributed.run_distributed`` in each rank).

* ``distributed``: run a test body on N real gloo processes;
* ``megatron``: tiny megatron-core GPT models and the plumbing to compare parallel layouts;
* ``async_ddp``: rank bodies of the async DDP tests.
"""
