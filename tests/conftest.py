import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU tests run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
