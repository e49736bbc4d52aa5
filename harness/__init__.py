"""Regression harness for Megatron-based training engines."""

import logging

__version__ = "0.1.0"

# torch's CUDA build on a machine without a GPU logs "No CUDA runtime is found" whenever torch.utils.cpp_extension is
# imported (megatron-core imports it): a line of noise in every CPU run, and a second line under a one-line refusal
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
