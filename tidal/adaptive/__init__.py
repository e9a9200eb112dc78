"""The adaptive core: the speculation policy, the step-cost models and per-request acceptance
statistics. Torch-free; imported by the engine, the simulator and config alike."""
