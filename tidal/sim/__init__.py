"""`tidal sim`: the engine's scheduler and speculation policy on simulated time, with roofline
or measured step-time models, for hardware tidal cannot run here; `tidal tune` turns a sweep
into batch-size-to-K schedules for tidal, vLLM and SGLang."""
