from raylm.cli import run

run()
