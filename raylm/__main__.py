import sys

from raylm.cli import main

sys.exit(main())
