"""`python -m lab.serve`: see lab/serve/cli.py."""

from lab.serve.cli import cli

cli()
