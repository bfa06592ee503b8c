"""The `pie` command line: each subcommand lives in its own module with a `register(subparsers)`."""
