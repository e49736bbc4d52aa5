"""The `harness` subcommands, one module each: `add_parser(sub)` registers its flags and sets its body as
`func`. harness/cli.py builds the parser from them. Module-level imports stay light (the CLI starts fast);
what a command needs is imported inside its body."""
