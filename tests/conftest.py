import pytest
import torch


def cuda_ready():
    if not torch.cuda.is_available():
        return False
    import flash_attn_ext
    return flash_attn_ext.has_cuda_kernels()


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    reason = "needs a CUDA GPU and a CUDA build of flash_attn_ext"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


# Every numerical test runs on the CPU and, marked `gpu`, on CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed_global_rng():
    # Tests draw dout etc. from the global generator; seeding it per test makes each test's
    # inputs independent of which tests ran before it (order, -k filters, skips, torch version
    # of the consumers before it), so a pass or failure reproduces.
    torch.manual_seed(0)


