"""Measuring on this host: plans and the baselines a user would run instead, timed side by side (`timing`), and the
`autotune bench` report built on it (`bench`)."""
