"""``python -m hpctp``: the ``hpctp`` command (:mod:`hpctp.cli.command`)."""

from .cli.command import cli

if __name__ == "__main__":
    cli()
