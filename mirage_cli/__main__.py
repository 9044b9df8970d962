"""`python -m mirage_cli` runs the `mirage` command line."""

from mirage_cli.cli import main

main()
