"""preflight: check a GPU cluster before a DeepSpeed/PyTorch job is submitted."""
__version__ = "0.1.0"
