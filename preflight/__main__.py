from preflight.cli import entry

entry()
