from __future__ import annotations

from trtedge._version import __version__


def version_text() -> str:
    import torch

    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)}), CUDA {torch.version.cuda}"
    else:
        device = "cpu (no CUDA device)"
    return f"trtedge {__version__}\ntorch {torch.__version__}\ndevice {device}"
