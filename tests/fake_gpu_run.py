"""``python -m um_alloc`` with install() working as on a node of two GPUs (conftest.fake_gpu_node),
for tests that start the launcher in processes of their own, as torchrun does, on a machine
without a GPU:

    PYTHONPATH=.:tests torchrun --nproc-per-node 2 -m fake_gpu_run run --budget 1GiB train.py ARGS
"""
import sys

import pytest
from conftest import fake_gpu_node

import um_alloc.__main__ as cli

if __name__ == "__main__":
    fake_gpu_node(pytest.MonkeyPatch())
    sys.exit(cli.main(sys.argv[1:]))
