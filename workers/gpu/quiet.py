"""The worker's log set-up for the libraries it runs: no tqdm progress bars (diffusers' and
transformers' loading and saving bars, the hub's downloads) and no torchvision-fallback notice, so a
worker's log holds its own records only ("Logs" in docs/operations.md)."""
from __future__ import annotations

import logging
import os

# transformers 5 says this once per image-processor class when torchvision is absent (it is not a
# dependency: the PIL processor it falls back to is what Stable Diffusion's feature extractor uses).
TORCHVISION_FALLBACK = "requires torchvision (not installed)"


class DropTorchvisionFallback(logging.Filter):
    """Drops transformers' torchvision-fallback notice; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return TORCHVISION_FALLBACK not in record.getMessage()


def quiet_libraries() -> None:
    """Turn off the libraries' progress bars and advisory notices for this process (idempotent).
    Call before the first pipeline is read or written; it imports diffusers and transformers."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()  # "Loading pipeline components...", "Fetching files"
    transformers_logging.disable_progress_bar()  # "Loading weights", "Writing model shards" (and the hub's)
    import_utils = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(each, DropTorchvisionFallback) for each in import_utils.filters):
        import_utils.addFilter(DropTorchvisionFallback())
