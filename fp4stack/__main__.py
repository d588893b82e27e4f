"""`python -m fp4stack` runs the `fp4stack` command."""

from .cli import program

program()
