"""Lets `python -m kvfsm.render` run the command line of `kvfsm.render.cli`."""

from kvfsm.render.cli import app

if __name__ == "__main__":
    app()
