"""The CUDA backend from PyTorch GPU tensors: inputs copied device to device,
outputs as views of the runtime's GPU memory. Skipped without a GPU, without
PyTorch's CUDA, or where the package was built without the CUDA backend
(scripts/device-python.sh runs them on the GPU machine)."""

import numpy as np
import pytest

import loom

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for PyTorch", allow_module_level=True)


@pytest.fixture
def gpu(bundles):
    try:
        session = loom.Session(bundles / "gpt-tiny-infer.loom", backend="cuda")
    except loom.LoomError as e:
        pytest.skip(f"no CUDA backend: {e}")
    with session:
        yield session


def test_gpu_tensors_in_and_views_out(gpu, bundles):
    assert gpu.device == ("cuda", 0)
    x = torch.randint(0, 256, (2, 32), dtype=torch.int32, device="cuda")
    gpu.forward(tokens=x)
    logits = torch.from_dlpack(gpu.output_view("logits"))
    assert logits.is_cuda and logits.data_ptr() == gpu.output_address("logits")
    with loom.Session(bundles / "gpt-tiny-infer.loom") as cpu:
        cpu.forward(tokens=x.cpu().numpy())
        np.testing.assert_allclose(logits.cpu().numpy(), cpu.output("logits"), rtol=2e-3, atol=2e-3)
    # The view follows the next run, in place.
    gpu.forward(tokens=torch.zeros((2, 32), dtype=torch.int32, device="cuda"))
    assert logits.data_ptr() == gpu.output_address("logits")
    np.testing.assert_array_equal(logits.cpu().numpy(), gpu.output("logits"))


def test_no_host_round_trip(gpu):
    """Binding a GPU tensor copies device to device only, and viewing an output
    copies nothing: what the profiler (CUPTI) sees of each."""
    from torch.profiler import ProfilerActivity, profile

    def copies(work):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            work()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.name.startswith("Memcpy")]  # the GPU's copies

    x = torch.randint(0, 256, (2, 32), dtype=torch.int32, device="cuda")
    gpu.forward(tokens=x)
    bound = copies(lambda: gpu.bind(tokens=x))
    if not bound:
        pytest.skip("the profiler recorded no copies (CUPTI unavailable?)")
    assert all("DtoD" in c for c in bound), bound
    viewed = copies(lambda: torch.from_dlpack(gpu.output_view("logits")).sum())
    assert viewed == [], viewed


def test_producer_stream_is_waited_for(gpu, bundles):
    """A tensor written on a busy side stream right before binding arrives
    whole: DLPack's stream handshake orders the runtime's copy after it."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is gone")
    x = torch.zeros((2, 32), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time
        x.fill_(7)
        gpu.forward(tokens=x)
    with loom.Session(bundles / "gpt-tiny-infer.loom") as cpu:
        cpu.forward(tokens=np.full((2, 32), 7, np.int32))
        np.testing.assert_allclose(gpu.output("logits"), cpu.output("logits"), rtol=2e-3, atol=2e-3)


def test_wrong_device_errors(gpu, bundles):
    with loom.Session(bundles / "gpt-tiny-infer.loom") as cpu:
        x = torch.zeros((2, 32), dtype=torch.int32, device="cuda")
        with pytest.raises(loom.LoomError, match="cpu backend"):
            cpu.bind(tokens=x)
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(1):
            y = torch.zeros((2, 32), dtype=torch.int32, device="cuda:1")
            with pytest.raises(loom.LoomError, match="CUDA device 1"):
                gpu.bind(tokens=y)
