"""Running, training, checkpoints and outputs through loom.Session (CPU backend)."""

import numpy as np
import pytest

import loom


def tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.int32)


def test_describes_the_bundle(infer):
    assert list(infer.inputs) == ["tokens"]
    assert infer.inputs["tokens"] == loom.TensorInfo("tokens", "int32", (2, 32), 256)
    assert infer.outputs["logits"].shape == (2, 32, 256)
    assert infer.outputs["logits"].dtype == "float32"
    assert infer.device == ("cpu", 0)
    assert (infer.rank, infer.num_ranks, infer.step) == (0, 1, 0)
    assert "tokens" in repr(infer)


def test_forward_is_deterministic_and_depends_on_the_input(infer):
    infer.forward(tokens=tokens((2, 32)))
    first = infer.output("logits")
    assert first.shape == (2, 32, 256) and first.dtype == np.float32
    assert np.isfinite(first).all()
    infer.forward({"tokens": tokens((2, 32), seed=1)})
    assert not np.array_equal(first, infer.output("logits"))
    infer.forward(tokens=tokens((2, 32)))
    np.testing.assert_array_equal(first, infer.output("logits"))


def test_inputs_from_lists_and_non_contiguous_arrays(infer):
    x = tokens((2, 32))
    infer.forward(tokens=x)
    want = infer.output("logits")
    infer.forward(tokens=x.tolist())
    np.testing.assert_array_equal(want, infer.output("logits"))
    wide = np.zeros((2, 64), np.int32)
    wide[:, ::2] = x
    infer.forward(tokens=wide[:, ::2])  # strided: copied to a contiguous array first
    np.testing.assert_array_equal(want, infer.output("logits"))


def test_output_view_is_the_runtimes_memory(infer):
    infer.forward(tokens=tokens((2, 32)))
    view = np.from_dlpack(infer.output_view("logits"))
    assert view.ctypes.data == infer.output_address("logits")
    np.testing.assert_array_equal(view, infer.output("logits"))
    copy = infer.output("logits")
    infer.forward(tokens=tokens((2, 32), seed=5))  # the view follows the next run; the copy does not
    np.testing.assert_array_equal(view, infer.output("logits"))
    assert not np.array_equal(view, copy)
    infer.close()
    assert float(np.abs(view).sum()) > 0  # the view keeps the memory alive past close()


def test_training_lowers_the_loss_and_counts_steps(train):
    data = np.arange(20000) % 16 + 1
    losses = [train.train_step(dict(zip(("tokens", "targets"), loom.token_batch(data, s, 4, 32))))
              for s in range(1, 21)]
    assert train.step == 20
    assert losses[-1] < 0.5 * losses[0], losses
    assert train.output("loss").shape == ()
    assert train.output("loss") == pytest.approx(losses[-1])


def test_checkpoint_resumes_the_same_losses(train, tmp_path):
    data = np.arange(20000) % 16 + 1
    batch = lambda s: dict(zip(("tokens", "targets"), loom.token_batch(data, s, 4, 32)))
    for s in range(1, 4):
        train.train_step(batch(s))
    train.save_checkpoint(tmp_path / "ckpt.safetensors")
    ahead = [train.train_step(batch(s)) for s in range(4, 7)]
    train.load_checkpoint(str(tmp_path / "ckpt.safetensors"))
    assert train.step == 3
    assert [train.train_step(batch(s)) for s in range(4, 7)] == ahead


def test_weights_round_trip(infer, tmp_path):
    x = tokens((2, 32))
    infer.forward(tokens=x)
    before = infer.output("logits")
    infer.save_weights(tmp_path / "w.safetensors")
    infer.load_weights(tmp_path / "w.safetensors")
    infer.forward(tokens=x)
    np.testing.assert_array_equal(before, infer.output("logits"))


def test_token_batch_windows():
    data = np.arange(100)
    x, y = loom.token_batch(data, 1, 2, 8)
    assert x.dtype == np.int32 and x.shape == (2, 8)
    np.testing.assert_array_equal(x[1], np.arange(8, 16))
    np.testing.assert_array_equal(y, x + 1)
    x, _ = loom.token_batch(data, 7, 2, 8)  # o = (6*2 + j)*8 mod 92: 96 -> 4, 104 -> 12
    np.testing.assert_array_equal(x[:, 0], [4, 12])
    with pytest.raises(ValueError, match="fewer than one batch"):
        loom.token_batch(np.arange(10), 1, 2, 8)
