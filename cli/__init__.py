"""The `slotserve` command line: `main` is the entry point; each command is its own module with
`add_parser(subparsers)` and `run(args)`; `common` holds the options several commands share."""
