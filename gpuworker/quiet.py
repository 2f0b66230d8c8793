"""The worker's log set-up for the libraries it runs: no progress bars and none of their notices that
say nothing (torchvision absent, an empty float32 list), so a worker's log holds its own records and
the libraries' real warnings; docs/operations.md, "Logs"."""
from __future__ import annotations

import logging
import os

# (logger, text) of each notice dropped. transformers 5 says the first once per image-processor
# class when torchvision is absent (it is not a dependency: the PIL processor it falls back to is
# what Stable Diffusion's feature extractor uses). diffusers says the second at every `.to(dtype)`
# of a model with no module to keep in float32 (SDXL's and SD3's VAE, at each job and frame): a
# list that is not empty is a real warning, and still shows.
EMPTY_NOTICES = (("transformers.utils.import_utils", "requires torchvision (not installed)"),
                 ("diffusers.models.modeling_utils", "that should be kept in float32: []."))


class DropNotice(logging.Filter):
    """Drops the records whose message holds `text`; every other record passes."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_libraries() -> None:
    """Turn off the libraries' progress bars and empty notices for this process (idempotent).
    Call before the first pipeline is read or written; it imports diffusers and transformers."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()  # "Loading pipeline components...", "Fetching files"
    transformers_logging.disable_progress_bar()  # "Loading weights", "Writing model shards" (and the hub's)
    for name, text in EMPTY_NOTICES:
        logger = logging.getLogger(name)
        if not any(isinstance(each, DropNotice) and each.text == text for each in logger.filters):
            logger.addFilter(DropNotice(text))
