"""stagewise's runtime: schedules as data, a simulator, and an executor across processes.

``pipeline.schedule`` is the schedule factory; import the module's other names with
``from pipeline.schedules.schedule import ...``.
"""

from pipeline.launch import DistInfo, RankError, init_distributed, launch
from pipeline.plan import Plan, StagePlan
from pipeline.runtime.p2p import PeerFailure, PipelineTimeout
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.recompute import CHECKPOINT_MODES, RECOMPUTE_MODES
from pipeline.schedules.actions import Action, Kind, format_action, parse_action
from pipeline.schedules.schedule import SCHEDULES, Schedule, ScheduleError, forward_only, schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import TimedAction, Timeline
from pipeline.schedules.trace import chrome_trace, render_grid, write_chrome_trace
from pipeline.schedules.validate import validate

__all__ = [
    "CHECKPOINT_MODES",
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "Action",
    "DistInfo",
    "Kind",
    "PeerFailure",
    "Pipeline",
    "PipelineTimeout",
    "Plan",
    "RankError",
    "Schedule",
    "ScheduleError",
    "StagePlan",
    "TimedAction",
    "Timeline",
    "chrome_trace",
    "format_action",
    "forward_only",
    "init_distributed",
    "launch",
    "parse_action",
    "render_grid",
    "schedule",
    "simulate",
    "validate",
    "write_chrome_trace",
]
