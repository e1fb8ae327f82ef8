"""Bad input is an exception with a clear message, never a crash."""

import numpy as np
import pytest

import loom


def test_missing_bundle(tmp_path):
    with pytest.raises(loom.LoomError, match="is not a bundle directory") as e:
        loom.Session(tmp_path / "nowhere.loom")
    assert e.value.code == "io_error"


def test_foreign_directory(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(loom.LoomError) as e:
        loom.Session(tmp_path)
    assert e.value.code == "invalid_bundle"
    assert "manifest.json" in str(e.value)


def test_bad_options(bundles):
    with pytest.raises(loom.LoomError, match="unknown backend 'tpu'"):
        loom.Session(bundles / "gpt-tiny-infer.loom", backend="tpu")
    with pytest.raises(loom.LoomError, match="num_threads"):
        loom.Session(bundles / "gpt-tiny-infer.loom", threads=-3)
    with pytest.raises(TypeError):
        loom.Session(bundles / "gpt-tiny-infer.loom", backend=None)


def test_wrong_dtype_shape_name_or_type(infer):
    with pytest.raises(TypeError, match=r"input 'tokens' is int32 of shape \(2, 32\), got int64"):
        infer.bind(tokens=np.zeros((2, 32), np.int64))
    with pytest.raises(TypeError, match="got float32"):
        infer.bind(tokens=np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match=r"got shape \(32, 2\)"):
        infer.bind(tokens=np.zeros((32, 2), np.int32))
    with pytest.raises(ValueError, match=r"got shape \(64,\)"):
        infer.bind(tokens=np.zeros(64, np.int32))
    with pytest.raises(TypeError, match="must be a NumPy array or a DLPack tensor"):
        infer.bind(tokens="hello")
    with pytest.raises(TypeError, match="must be a NumPy array or a DLPack tensor"):
        infer.bind(tokens=None)
    with pytest.raises(loom.LoomError, match="no input named 'ids'; the bundle has: tokens") as e:
        infer.bind(ids=np.zeros((2, 32), np.int32))
    assert e.value.code == "invalid_argument"
    with pytest.raises(loom.LoomError, match="no output named 'probs'"):
        infer.output("probs")
    with pytest.raises(loom.LoomError, match="no output named 'probs'"):
        infer.output_view("probs")


def test_token_outside_the_vocabulary(infer):
    x = np.zeros((2, 32), np.int32)
    x[1, 3] = 256
    with pytest.raises(loom.LoomError, match=r"token id in 'tokens' 256 at position 35 is outside \[0, 256\)"):
        infer.forward(tokens=x)


def test_inference_bundle_does_not_train(infer):
    with pytest.raises(loom.LoomError, match="compiled for inference"):
        infer.train_step()


def test_closed_session(infer):
    infer.close()
    infer.close()  # harmless
    assert infer.closed and "closed" in repr(infer)
    for call in (infer.forward, infer.train_step, lambda: infer.output("logits"),
                 lambda: infer.output_view("logits"), lambda: infer.save_weights("w.safetensors"),
                 lambda: infer.bind(tokens=np.zeros((2, 32), np.int32)), lambda: infer.step):
        with pytest.raises(loom.LoomError, match="the session is closed"):
            call()


def test_bad_checkpoint_leaves_the_session_alone(train, tmp_path):
    with pytest.raises(loom.LoomError) as e:
        train.load_checkpoint(tmp_path / "none.safetensors")
    assert e.value.code == "io_error"
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(loom.LoomError):
        train.load_checkpoint(damaged)
    with pytest.raises(loom.LoomError):
        train.load_weights(damaged)
    with pytest.raises(loom.LoomError):
        train.save_checkpoint(tmp_path / "no" / "such" / "dir" / "c.safetensors")
    assert train.step == 0


def test_gpu_memory_on_the_cpu_backend(infer):
    class FakeCudaTensor:  # claims CUDA memory, as a GPU tensor's DLPack would
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            raise BufferError("no GPU here")

    with pytest.raises(TypeError, match="input 'tokens': cannot export it through DLPack"):
        infer.bind(tokens=FakeCudaTensor())
