import sys

from cpplan.cli import main

sys.exit(main())
