"""The `autopar` command: argument parsing and output only, over the library functions of the other rooms. `main`
builds the parser; each sub-command module registers itself; `common` holds what they share.

May import every other room; nothing imports the CLI.
"""
