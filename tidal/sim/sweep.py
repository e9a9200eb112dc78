"""A simulated concurrency sweep: every speculation mode at every concurrency."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tidal.adaptive.cost import (DEFAULT_KNOTS, PROFILE_BATCH_SIZES, PROFILE_DRAFT_LENGTHS, PROFILE_MAX_TOKENS,
                                 PROFILE_PROMPT_LEN)
from tidal.config import SchedulerConfig
from tidal.sim.report import make_record
from tidal.sim.simulator import AcceptanceModel, Simulator, SpecMode, StepTimeModel, Workload
from tidal.sweeps.records import BenchRecord


@dataclass(frozen=True)
class SweepConfig:
    """Everything but the step-time model and the modes."""

    concurrency: tuple[int, ...]
    input_len: int = 1024
    output_len: int = 128
    num_prompts: int | None = None  # per level, at least C as in tidal bench; None: 4 x concurrency, at least 8
    acceptance: AcceptanceModel = AcceptanceModel((0.7,))
    scheduler: SchedulerConfig = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    num_blocks: int | None = None  # None: enough for every request in flight
    block_size: int = 16
    seed: int = 0
    spec_max_running: int | None = None  # the running-batch cap of fixed and scheduled K (SGLang's EAGLE default: 48)

    def scheduler_for(self, mode: SpecMode) -> SchedulerConfig:
        """The scheduler a mode runs with: `spec_max_running` caps the batch of a fixed or
        scheduled K, what an engine that drafts for every request runs; adaptive is tidal's own
        scheduler, which turns drafting off instead of capping the batch."""
        if not (self.spec_max_running and mode.mode in ("fixed", "schedule")):
            return self.scheduler
        return replace(self.scheduler, max_num_seqs=min(self.scheduler.max_num_seqs, self.spec_max_running))

    def workload(self, concurrency: int) -> Workload:
        # never fewer than C, as `tidal bench` does: 8 requests "at 16" would be a level of 8
        n = max(self.num_prompts, concurrency) if self.num_prompts else max(8, 4 * concurrency)
        return Workload(concurrency, n, self.input_len, self.output_len)

    def blocks(self, concurrency: int, max_k: int) -> int:
        if self.num_blocks:
            return self.num_blocks
        per_request = -(-(self.input_len + self.output_len + max_k + 1) // self.block_size)
        profile = -(-(PROFILE_PROMPT_LEN + PROFILE_MAX_TOKENS + max(PROFILE_DRAFT_LENGTHS)) // self.block_size)
        return per_request * concurrency + max(PROFILE_BATCH_SIZES) * profile + 1


def simulate(model: StepTimeModel, mode: SpecMode, concurrency: int, config: SweepConfig) -> BenchRecord:
    """One sweep point, from a fresh simulator (as a freshly started server would be); the
    policy's cost model gets the step model's knots where it has them (a measured profile)."""
    sim = Simulator(model, mode, config.acceptance, config.scheduler_for(mode), config.blocks(concurrency, mode.max_k),
                    config.block_size, config.seed, getattr(model, "knots", DEFAULT_KNOTS))
    return make_record(mode.label, concurrency, sim.run(config.workload(concurrency)))


def sweep(model: StepTimeModel, modes: list[SpecMode], config: SweepConfig, progress=None) -> list[BenchRecord]:
    """Records for every (mode, concurrency), concurrency-major like `tidal bench`."""
    records = []
    for c in config.concurrency:
        for mode in modes:
            records.append(simulate(model, mode, c, config))
            if progress is not None:
                progress(records[-1])
    return records
