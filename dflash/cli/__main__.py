"""`python -m dflash.cli`, the command line's older name: runs the `dflash` command, which lives
beside the stages it calls (stages/cli.py). An entry script, never imported by the library."""

from stages.cli import main

if __name__ == "__main__":
    main()
