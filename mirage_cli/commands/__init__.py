"""One module per `mirage` subcommand; each defines ``command`` (a click command)."""
