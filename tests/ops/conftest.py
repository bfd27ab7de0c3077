"""The operators' tests check their torch.compile contracts (fullgraph, FakeTensor kernels, opcheck): they
run with torch.compile on, which the rest of the suite turns off (tests/conftest.py)."""
import pytest
import torch._dynamo


@pytest.fixture(autouse=True)
def torch_compile_on():
    with torch._dynamo.config.patch(disable=False):
        yield
