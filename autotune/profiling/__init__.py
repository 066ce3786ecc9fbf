"""Microbenchmarks of this host's backends on the shapes the executor really runs.

Every record times runtime code, not a reimplementation:
- `group` (and tiny `call`) records: one static group call from `CpuStaticBackend.prepare` (G experts x capacity
  C), or one `run_exact` call over G experts (cpu-exact); G=1 across M = 1..thousands gives the per-expert curve;
- `pack` records: one `LayerExecutor` chunk whose groups run on a null backend (identity), i.e. the executor's
  routing bookkeeping, packing, unpacking and weighted combine with no expert compute;
- `exact_host` records: one all-exact `LayerExecutor` chunk given identity as its exact compute: the exact
  path's sorting, gathering and scattering;
- on macOS with coremltools, `ane` (Core ML, CPU_AND_NE) and `coreml-cpu` (Core ML, CPU_ONLY) group calls.
Each record keeps warm-up count, runs, median and spread; energy comes from an `EnergyMeter` when one is readable
(RAPL on Linux, zeus-apple-silicon on macOS) and is otherwise absent.

The parts: `settings` (what to measure), `energy` (the meters), `timing` (one record), `callers` (the runtime calls
timed); `device` plans the tasks, runs them and hands the records to `profile.build_profile` (`profile_device`).
"""
