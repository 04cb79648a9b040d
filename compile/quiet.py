"""Silence the torch/diffusers/transformers chatter (deprecations, progress bars) during compile."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ("transformers", "diffusers", "torch", "iree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - only cosmetics
        pass
    try:
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass
