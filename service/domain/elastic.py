"""What an elastic job (``resources.min_workers``) runs on each world size it may get: the planner's
re-plan for it, made by the scheduler before the run (service/memory/elastic.py) and applied by the
workers to the world size Ray Train starts them with (workers/elastic.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WorldPlan(BaseModel):
    """The job on ``world_size`` workers: the batch split that keeps its global batch, and whether its
    plan fits. ``problem`` says why the world size cannot run the job (the global batch does not split
    evenly, a rule of the spec, or the plan does not fit); None when it can."""

    model_config = ConfigDict(extra="forbid")

    world_size: int = Field(..., ge=1)
    data_parallel_size: int = Field(..., ge=1)
    micro_batch_size: int = Field(..., ge=1)
    gradient_accumulation_steps: int = Field(..., ge=1)
    global_batch_size: int = Field(..., ge=1)
    fits: bool | None = Field(None, description="The planner's verdict; None when it was not planned (see problem).")
    need_bytes: int | None = None
    peak_bytes: int | None = None
    usable_bytes: int | None = None
    problem: str | None = None
    code: str | None = Field(None, description="The failure code when problem is set: insufficient_memory "
                                               "(the plan does not fit) or elastic_world_size.")
