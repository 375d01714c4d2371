import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Run a test on CPU, and on CUDA where a GPU is present."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def seeded_global_rng():
    """Tests that draw from the global RNG get the same data whatever ran before them."""
    torch.manual_seed(0)
