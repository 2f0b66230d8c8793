"""The memory rungs a model runs on, highest first, and the memory modes that pin one (MEMORY_MODE)."""
from __future__ import annotations

RUNG_FULL = "full"  # the whole pipeline on the device: the only rung that serves realtime sessions
RUNG_MODEL_OFFLOAD = "model_offload"
RUNG_GROUP_OFFLOAD = "group_offload"
RUNGS = (RUNG_FULL, RUNG_MODEL_OFFLOAD, RUNG_GROUP_OFFLOAD)
MODE_AUTO = "auto"  # each model on the highest rung that fits, moved down after an out-of-memory error
MEMORY_MODES = (MODE_AUTO, *RUNGS)
