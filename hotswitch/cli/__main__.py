"""`python -m hotswitch.cli ...`: the same as the `hotswitch` command."""
import sys

from hotswitch.cli import main

sys.exit(main())
