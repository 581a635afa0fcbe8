import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import byte_tokenizer, tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny Llama saved as a Hugging Face model directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (converted once into the JetFlow cache)."""
    from jetflow.models.target import TargetModel

    return TargetModel.load("smollm2-135m-instruct")
