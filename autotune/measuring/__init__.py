"""Measuring on this host: plans and the baselines a user would run instead, timed side by side
(`side_by_side`), and the `autotune bench` run built on it (`bench_run`)."""
