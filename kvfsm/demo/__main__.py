"""`python -m kvfsm.demo` runs the demo's command line (`kvfsm.demo.cli`)."""

from kvfsm.demo.cli import app

if __name__ == "__main__":
    app()
