"""One module per `autotune` subcommand; each exposes `register(subparsers)` and sets `func(args) -> int`."""
