"""stagewise's runtime: schedules as data, a simulator, and an executor across processes."""

from pipeline.actions import Action, Kind, format_action, parse_action
from pipeline.launch import DistInfo, RankError, init_distributed, launch

__all__ = [
    "Action",
    "DistInfo",
    "Kind",
    "RankError",
    "format_action",
    "init_distributed",
    "launch",
    "parse_action",
]
