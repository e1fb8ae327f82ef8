"""Inputs and outputs through DLPack with PyTorch on the CPU (skipped without PyTorch)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def test_torch_inputs_and_zero_copy_outputs(infer):
    x = torch.randint(0, 256, (2, 32), dtype=torch.int32)
    infer.forward(tokens=x)
    want = infer.output("logits")
    logits = torch.from_dlpack(infer.output_view("logits"))
    assert logits.data_ptr() == infer.output_address("logits")
    assert logits.dtype == torch.float32 and tuple(logits.shape) == (2, 32, 256)
    np.testing.assert_array_equal(logits.numpy(), want)
    infer.forward(tokens=x.numpy())
    np.testing.assert_array_equal(logits.numpy(), want)


def test_torch_errors(infer):
    with pytest.raises(TypeError, match="got int64"):
        infer.bind(tokens=torch.zeros((2, 32), dtype=torch.int64))
    with pytest.raises(ValueError, match="not contiguous"):
        infer.bind(tokens=torch.zeros((32, 2), dtype=torch.int32).t())
    with pytest.raises(TypeError, match="cannot export it through DLPack"):
        infer.bind(tokens=torch.zeros((2, 32), dtype=torch.float32, requires_grad=True))


def test_training_from_torch_tensors(train):
    data = torch.arange(20000, dtype=torch.int32) % 16 + 1
    first = None
    for step in range(10):
        o = step * 4 * 32
        x = data[o:o + 128].reshape(4, 32)
        y = data[o + 1:o + 129].reshape(4, 32)
        loss = train.train_step(tokens=x, targets=y)
        first = first or loss
    assert loss < first
