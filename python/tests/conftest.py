"""Bundles for the tests: compiled with the build's loomc (LOOM_BUILD_DIR, as
scripts/python-test.sh sets it), or taken from LOOM_TEST_BUNDLES on a machine
without the compiler (scripts/device-python.sh: gpt-tiny-infer.loom and
gpt-tiny-train.loom there)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> Path:
    build = os.environ.get("LOOM_BUILD_DIR")
    for sub in ("compiler", "runtime"):
        path = Path(build or ROOT / "build") / sub / name
        if path.exists():
            return path
    return Path()


@pytest.fixture(scope="session")
def loom_run() -> Path:
    """The build's loom-run, which the Python losses are checked against."""
    path = _tool("loom-run")
    if not path.name:
        pytest.skip("no loom-run in LOOM_BUILD_DIR")
    return path


@pytest.fixture(scope="session")
def small_gpt_train(tmp_path_factory, loom_run) -> Path:
    """The quickstart's small GPT (4 layers of 256, sequence 128, vocabulary 512),
    compiled for training as scripts/quickstart.sh compiles it."""
    loomc = _tool("loomc")
    if not loomc.name:
        pytest.skip("no loomc in LOOM_BUILD_DIR")
    out = tmp_path_factory.mktemp("small")
    subprocess.run([str(loomc), "models", "gpt", "--layers", "4", "--hidden", "256", "--heads", "4",
                    "--seq", "128", "--vocab", "512", "-o", str(out / "gpt-small.mlir")],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([str(loomc), "compile", str(out / "gpt-small.mlir"), "--train", "--batch", "4",
                    "--lr", "1e-3", "--warmup", "10", "--total-steps", "40",
                    "-o", str(out / "gpt-small-train.loom")], check=True, stdout=subprocess.DEVNULL)
    return out / "gpt-small-train.loom"


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> Path:
    """A folder with gpt-tiny-infer.loom (batch 2) and gpt-tiny-train.loom (batch 4)."""
    carried = os.environ.get("LOOM_TEST_BUNDLES")
    if carried:
        return Path(carried)
    loomc = _tool("loomc")
    if not loomc.name:
        pytest.skip("no loomc in LOOM_BUILD_DIR and no LOOM_TEST_BUNDLES")
    out = tmp_path_factory.mktemp("bundles")
    model = ROOT / "models" / "gpt-tiny.mlir"
    for name, args in {
        "gpt-tiny-infer.loom": ["--batch", "2"],
        "gpt-tiny-train.loom": ["--train", "--batch", "4", "--lr", "3e-3", "--warmup", "5",
                                "--total-steps", "40"],
    }.items():
        subprocess.run([str(loomc), "compile", str(model), *args, "-o", str(out / name)],
                       check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture
def infer(bundles):
    import loom
    with loom.Session(bundles / "gpt-tiny-infer.loom", threads=1) as session:
        yield session


@pytest.fixture
def train(bundles):
    import loom
    with loom.Session(bundles / "gpt-tiny-train.loom", threads=1) as session:
        yield session
